//! RAID5 and RAID6 parity: P is the XOR of a full stripe's data blocks, Q (RAID6) their sum
//! weighted by powers of 2 in GF(2^8) with the polynomial x^8+x^4+x^3+x^2+1 (0x11d), the
//! field Linux's RAID6 uses. Data block `i` (its index in logical order, not its device)
//! carries the weight `2^i`. [`rebuild`] recovers up to two lost blocks of a full stripe.

/// Log and antilog tables of GF(2^8) over 0x11d with generator 2.
struct Tables {
    exp: [u8; 512],
    log: [u8; 256],
}

const fn tables() -> Tables {
    let mut exp = [0u8; 512];
    let mut log = [0u8; 256];
    let mut x: u16 = 1;
    let mut i = 0;
    while i < 255 {
        exp[i] = x as u8;
        exp[i + 255] = x as u8;
        log[x as usize] = i as u8;
        x <<= 1;
        if x & 0x100 != 0 {
            x ^= 0x11d;
        }
        i += 1;
    }
    // exp[510..512] stay 0: never reached (log values are below 255, sums below 510).
    Tables { exp, log }
}

static GF: Tables = tables();

/// a * b in GF(2^8).
fn mul(a: u8, b: u8) -> u8 {
    if a == 0 || b == 0 {
        return 0;
    }
    GF.exp[GF.log[a as usize] as usize + GF.log[b as usize] as usize]
}

/// 2^e in GF(2^8).
fn pow2(e: usize) -> u8 {
    GF.exp[e % 255]
}

/// The multiplicative inverse of a non-zero `a`.
fn inv(a: u8) -> u8 {
    debug_assert!(a != 0);
    GF.exp[(255 - GF.log[a as usize] as usize) % 255]
}

/// `dst ^= c * src`, bytewise.
fn mul_add(dst: &mut [u8], src: &[u8], c: u8) {
    if c == 1 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d ^= s;
        }
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d ^= mul(*s, c);
    }
}

/// P (and Q when `with_q`) of the data blocks `data`, all of one length.
pub(crate) fn parity(data: &[&[u8]], with_q: bool) -> (Vec<u8>, Option<Vec<u8>>) {
    let len = data.first().map_or(0, |d| d.len());
    let mut p = vec![0u8; len];
    let mut q = with_q.then(|| vec![0u8; len]);
    for (i, d) in data.iter().enumerate() {
        mul_add(&mut p, d, 1);
        if let Some(q) = q.as_mut() {
            mul_add(q, d, pow2(i));
        }
    }
    (p, q)
}

/// Fills the lost blocks (`None`) of one full stripe: `blocks` holds the `nd` data blocks in
/// logical order, then P, then Q when `nparity` is 2, all of one length. Returns false when
/// more blocks are lost than the parity can restore (more than `nparity`), or when the block
/// needed to restore them (P for RAID5) is itself lost.
pub(crate) fn rebuild(blocks: &mut [Option<Vec<u8>>], nparity: usize) -> bool {
    let n = blocks.len();
    if nparity == 0 || nparity > 2 || n <= nparity {
        return false;
    }
    let nd = n - nparity;
    let lost: Vec<usize> = (0..n).filter(|&i| blocks[i].is_none()).collect();
    if lost.len() > nparity {
        return false;
    }
    let Some(len) = blocks.iter().flatten().map(|b| b.len()).next() else {
        return false;
    };
    let lost_data: Vec<usize> = lost.iter().copied().filter(|&i| i < nd).collect();
    let p_lost = blocks[nd].is_none();
    // The data first; P and Q are recomputed from the data afterwards.
    match lost_data.as_slice() {
        [] => {}
        [x] if !p_lost => {
            // D_x = P xor every other data block.
            let mut d = blocks[nd].clone().unwrap_or_default();
            for (i, b) in blocks[..nd].iter().enumerate() {
                if i != *x {
                    if let Some(b) = b {
                        mul_add(&mut d, b, 1);
                    }
                }
            }
            blocks[*x] = Some(d);
        }
        [x] => {
            // P lost too: from Q. Q xor Q' (Q over the other data) = 2^x * D_x.
            let Some(q) = blocks.get(nd + 1).cloned().flatten() else {
                return false;
            };
            let mut acc = q;
            for (i, b) in blocks[..nd].iter().enumerate() {
                if let Some(b) = b {
                    mul_add(&mut acc, b, pow2(i));
                }
            }
            let c = inv(pow2(*x));
            blocks[*x] = Some(acc.iter().map(|&v| mul(v, c)).collect());
        }
        [x, y] => {
            // Both parities present. A = P xor the others = D_x ^ D_y;
            // B = Q xor the others = 2^x D_x ^ 2^y D_y. So (2^x ^ 2^y) D_y = B ^ 2^x A.
            let (Some(p), Some(q)) = (blocks[nd].clone(), blocks[nd + 1].clone()) else {
                return false;
            };
            let (mut a, mut b) = (p, q);
            for (i, d) in blocks[..nd].iter().enumerate() {
                if let Some(d) = d {
                    mul_add(&mut a, d, 1);
                    mul_add(&mut b, d, pow2(i));
                }
            }
            let (gx, gy) = (pow2(*x), pow2(*y));
            let c = inv(gx ^ gy);
            let dy: Vec<u8> = (0..len).map(|i| mul(b[i] ^ mul(a[i], gx), c)).collect();
            let dx: Vec<u8> = (0..len).map(|i| a[i] ^ dy[i]).collect();
            blocks[*x] = Some(dx);
            blocks[*y] = Some(dy);
        }
        _ => return false,
    }
    if lost.iter().any(|&i| i >= nd) {
        let data: Vec<&[u8]> = blocks[..nd].iter().flatten().map(|b| &b[..]).collect();
        let (p, q) = parity(&data, nparity == 2);
        blocks[nd] = Some(p);
        if nparity == 2 {
            blocks[nd + 1] = q;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stripe(nd: usize, len: usize, seed: u8) -> Vec<Vec<u8>> {
        (0..nd)
            .map(|i| {
                (0..len)
                    .map(|j| (j as u8).wrapping_mul(31) ^ seed ^ (i as u8).wrapping_mul(77))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn field_is_the_one_linux_raid6_uses() {
        // 2^8 = 0x1d under 0x11d; every non-zero element has an inverse.
        assert_eq!(pow2(8), 0x1d);
        assert_eq!(mul(0x80, 2), 0x1d);
        for a in 1..=255u8 {
            assert_eq!(mul(a, inv(a)), 1, "inverse of {a}");
        }
        // Q of one data block is the block; of D1 alone it is twice D1.
        let (p, q) = parity(&[&[0, 0], &[1, 0x80]], true);
        assert_eq!(p, vec![1, 0x80]);
        assert_eq!(q.unwrap(), vec![2, 0x1d]);
    }

    #[test]
    fn every_pair_of_lost_blocks_comes_back() {
        for nd in 1..=5 {
            let data = stripe(nd, 64, nd as u8);
            let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
            let (p, q) = parity(&refs, true);
            let mut full: Vec<Vec<u8>> = data.clone();
            full.push(p);
            full.push(q.unwrap());
            let n = full.len();
            for x in 0..n {
                for y in x..n {
                    let mut b: Vec<Option<Vec<u8>>> = full.iter().cloned().map(Some).collect();
                    b[x] = None;
                    b[y] = None;
                    assert!(rebuild(&mut b, 2), "nd {nd} lost {x},{y}");
                    let got: Vec<Vec<u8>> = b.into_iter().map(|v| v.unwrap()).collect();
                    assert_eq!(got, full, "nd {nd} lost {x},{y}");
                }
            }
            // RAID5: any one block; two are too many.
            let mut r5: Vec<Option<Vec<u8>>> = full[..nd + 1].iter().cloned().map(Some).collect();
            for x in 0..=nd {
                let mut b = r5.clone();
                b[x] = None;
                assert!(rebuild(&mut b, 1));
                assert_eq!(b, r5);
            }
            if nd >= 1 {
                r5[0] = None;
                r5[nd] = None;
                assert!(!rebuild(&mut r5, 1));
            }
        }
    }
}
