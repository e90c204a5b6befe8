//! Temporary minimal checksum API (replaced by the codecs branch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CsumType {
    Crc32c,
    Xxhash64,
    Sha256,
    Blake2b,
}
impl CsumType {
    pub fn from_disk(v: u16) -> Option<CsumType> {
        Some(match v {
            0 => CsumType::Crc32c,
            1 => CsumType::Xxhash64,
            2 => CsumType::Sha256,
            3 => CsumType::Blake2b,
            _ => return None,
        })
    }
    pub fn to_disk(self) -> u16 {
        self as u16
    }
    pub fn size(self) -> usize {
        match self {
            CsumType::Crc32c => 4,
            CsumType::Xxhash64 => 8,
            _ => 32,
        }
    }
    pub fn name(self) -> &'static str {
        "crc32c"
    }
    pub fn compute(self, data: &[u8]) -> [u8; 32] {
        let mut o = [0u8; 32];
        o[..4].copy_from_slice(&crc32c::crc32c(data).to_le_bytes());
        o
    }
}
