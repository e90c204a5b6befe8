use butter::fs::Fs;
use butter::inode::namespace::Owner;
fn main() -> butter::Result<()> {
    let path = std::env::args().nth(1).expect("image");
    let n: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse().unwrap())
        .unwrap_or(10);
    let fs = Fs::open_rw(std::path::Path::new(&path))?;
    let root = fs.root_inode();
    let o = Owner { uid: 0, gid: 0 };
    let d = fs.mkdir(root, b"dir", 0o755, o)?;
    for i in 0..n {
        let f = fs.create(d, format!("file{i}").as_bytes(), 0o644, o)?;
        let data: Vec<u8> = (0..(i * 997 % 20000)).map(|x| (x * 7 + i) as u8).collect();
        fs.write(f, 0, &data)?;
    }
    let big = fs.create(root, b"big", 0o644, o)?;
    let data: Vec<u8> = (0..3_000_000u32).map(|x| (x % 251) as u8).collect();
    fs.write(big, 0, &data)?;
    fs.write(big, 5000, b"hello world")?;
    fs.symlink(root, b"link", b"dir/file1", o)?;
    fs.setxattr(big, b"user.test", b"value", 0)?;
    fs.commit()?;
    if n > 5 {
        fs.unlink(d, b"file3")?;
        fs.rename(d, b"file4", root, b"moved", 0)?;
        fs.link(big, d, b"biglink")?;
        fs.truncate(big, 100_000)?;
        fs.commit()?;
    }
    eprintln!("descents {}", fs.stats()?.descents.0);
    Ok(())
}
