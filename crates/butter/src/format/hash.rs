//! Temporary name hash (replaced by the codecs branch).
fn raw(seed: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!seed, data)
}
pub fn name_hash(name: &[u8]) -> u64 {
    raw(0xFFFF_FFFE, name) as u64
}
pub fn extref_hash(parent_ino: u64, name: &[u8]) -> u64 {
    raw(parent_ino as u32, name) as u64
}
