use butter::fs::Fs;
use butter::inode::namespace::Owner;
fn main() -> butter::Result<()> {
    let path = std::env::args().nth(1).expect("image");
    let fs = Fs::open_rw(std::path::Path::new(&path))?;
    let root = fs.root_inode();
    let o = Owner { uid: 0, gid: 0 };
    let data: Vec<u8> = (0..30000u32).map(|x| (x % 251 + 1) as u8).collect();
    let check = |name: &str, f: butter::fs::Inode, upto: usize| -> butter::Result<()> {
        let st = fs.stat(f)?;
        let d = fs.read(f, 0, st.size as usize)?;
        let bad = d.iter().enumerate().skip(upto).find(|(_, b)| **b != 0);
        println!(
            "{name}: size {} first nonzero past {upto}: {:?}",
            st.size,
            bad.map(|x| x.0)
        );
        Ok(())
    };
    // 1: truncate down unaligned then write far
    let f = fs.create(root, b"a", 0o644, o)?;
    fs.write(f, 0, &data)?;
    fs.commit()?;
    fs.truncate(f, 4096)?;
    fs.commit()?;
    fs.truncate(f, 493)?;
    fs.write(f, 534691, &data[..1000])?;
    check("a", f, 493)?;
    // 2: via setattr size
    let g = fs.create(root, b"b", 0o644, o)?;
    fs.write(g, 0, &data)?;
    fs.commit()?;
    fs.setattr(
        g,
        &butter::inode::namespace::SetAttr {
            size: Some(493),
            ..Default::default()
        },
    )?;
    fs.write(g, 534691, &data[..1000])?;
    check("b", g, 493)?;
    // 3: punch the tail then truncate
    let h = fs.create(root, b"c", 0o644, o)?;
    fs.write(h, 0, &data)?;
    fs.fallocate(h, 3, 493, 30000)?;
    fs.truncate(h, 493)?;
    fs.write(h, 534691, &data[..1000])?;
    check("c", h, 493)?;
    // 4: truncate up then the old tail
    let i = fs.create(root, b"d", 0o644, o)?;
    fs.write(i, 0, &data[..493])?; // inline
    fs.write(i, 100000, &data[..10])?;
    check("d", i, 493)?;
    let j = fs.create(root, b"e", 0o644, o)?;
    fs.write(j, 0, &data)?;
    fs.fallocate(j, 0x10 | 1, 493, 40000)?; // zero range keep size
    fs.truncate(j, 493)?;
    fs.write(j, 534691, &data[..10])?;
    check("e", j, 493)?;
    fs.commit()?;
    Ok(())
}
