//! Temporary stub (replaced by the codecs branch).
pub fn decompress(
    compression: u8,
    _input: &[u8],
    _ram_bytes: usize,
    _sectorsize: u32,
) -> crate::Result<Vec<u8>> {
    Err(crate::Error::Unsupported(format!(
        "compression {compression}"
    )))
}
