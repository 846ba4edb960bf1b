//! The address half of the prefilter, kept as `addrs` changes: its three
//! bitmaps (every address, the pods, the foreign LB IPs: see
//! [`Prefilter`]), and for each bit set by more than one address, how
//! many set it (it is cleared when the last one leaves). A change costs
//! what it touches, not a pass over every address. Which addresses are in
//! the map is the caller's to know (it keeps them anyway: no second set of
//! them here).
use cozy_proxy_common::{prefilter, IpKey, Prefilter};
use std::collections::HashMap;

/// One bitmap.
struct Bitmap {
    words: Box<[u64]>,
    /// Bit index (word * 64 + bit) -> how many addresses set it, for the
    /// bits more than one sets (a few in ten at 100 000 addresses in 2^20
    /// bits: a count per bit set was most of this type's memory).
    shared: HashMap<u32, u32>,
}

impl Bitmap {
    fn new() -> Self {
        Bitmap {
            words: vec![0; prefilter::WORDS].into_boxed_slice(),
            shared: HashMap::new(),
        }
    }

    fn add(&mut self, (word, bit): (usize, u64)) {
        if self.words[word] & bit == 0 {
            self.words[word] |= bit;
        } else {
            *self.shared.entry(index(word, bit)).or_insert(1) += 1;
        }
    }

    fn remove(&mut self, (word, bit): (usize, u64)) {
        let i = index(word, bit);
        match self.shared.get_mut(&i) {
            Some(n) if *n > 2 => *n -= 1,
            Some(_) => {
                self.shared.remove(&i);
            }
            None => self.words[word] &= !bit,
        }
    }
}

pub struct AddrBits {
    all: Bitmap,
    pods: Bitmap,
    foreign_lbs: Bitmap,
}

impl AddrBits {
    /// The bits of `entries` (each address once, with its entry's flags).
    pub fn of(entries: impl IntoIterator<Item = (IpKey, u16)>) -> Self {
        let mut bits = AddrBits {
            all: Bitmap::new(),
            pods: Bitmap::new(),
            foreign_lbs: Bitmap::new(),
        };
        for (a, flags) in entries {
            bits.add(a, prefilter::roles(flags));
        }
        bits
    }

    fn bitmaps(&mut self, roles: u8) -> impl Iterator<Item = &mut Bitmap> {
        [
            (prefilter::ALL, &mut self.all),
            (prefilter::PODS, &mut self.pods),
            (prefilter::FOREIGN_LBS, &mut self.foreign_lbs),
        ]
        .into_iter()
        .filter(move |(r, _)| roles & r != 0)
        .map(|(_, b)| b)
    }

    /// Sets `a`'s bit in the bitmaps of `roles` ([`prefilter::roles`]):
    /// `a` takes them.
    pub fn add(&mut self, a: IpKey, roles: u8) {
        let slot = prefilter::slot(a.fold());
        self.bitmaps(roles).for_each(|b| b.add(slot));
    }

    /// Clears `a`'s bit in the bitmaps of `roles` unless another address
    /// still sets it there: `a`, which had them, lost them.
    pub fn remove(&mut self, a: &IpKey, roles: u8) {
        let slot = prefilter::slot(a.fold());
        self.bitmaps(roles).for_each(|b| b.remove(slot));
    }

    /// Copies the bitmaps into `p`.
    pub fn write_into(&self, p: &mut Prefilter) {
        p.words.copy_from_slice(&self.all.words);
        p.pods.copy_from_slice(&self.pods.words);
        p.foreign_lbs.copy_from_slice(&self.foreign_lbs.words);
    }
}

fn index(word: usize, bit: u64) -> u32 {
    (word as u32) * 64 + bit.trailing_zeros()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cozy_proxy_common::addr;
    use std::net::IpAddr;

    fn key(s: &str) -> IpKey {
        let ip: IpAddr = s.parse().expect("ip");
        IpKey::from(ip)
    }

    fn set(words: &[u64], (word, bit): (usize, u64)) -> bool {
        words[word] & bit != 0
    }

    #[test]
    fn a_bit_shared_by_two_addresses_stays_until_both_leave() {
        // An IPv6 address folds to the xor of its four words: two with
        // their last two words swapped share a bit.
        let (base, other, third) = (
            key("2001:db8::1:0:2"),
            key("2001:db8::2:0:1"),
            key("2001:db8::3"),
        );
        let slot = prefilter::slot(base.fold());
        assert_eq!(prefilter::slot(other.fold()), slot);
        let pod = addr::POD | addr::LOCAL;
        let mut bits = AddrBits::of([(base, pod), (other, pod)]);
        bits.add(third, prefilter::roles(pod));
        assert!(set(&bits.all.words, slot) && set(&bits.pods.words, slot));
        bits.remove(&base, prefilter::roles(pod));
        assert!(set(&bits.all.words, slot), "still set by the other");
        assert!(set(&bits.pods.words, slot), "still set by the other");
        bits.remove(&other, prefilter::roles(pod));
        bits.remove(&third, prefilter::roles(pod));
        for b in [&bits.all, &bits.pods, &bits.foreign_lbs] {
            assert!(b.words.iter().all(|w| *w == 0));
            assert!(b.shared.is_empty());
        }
    }

    #[test]
    fn each_bitmap_holds_the_addresses_of_its_role() {
        let local_lb = key("203.0.113.1");
        let remote_lb = key("203.0.113.2");
        let unmapped = key("203.0.113.3");
        let pod = key("192.0.2.1");
        let bits = AddrBits::of([
            (local_lb, addr::LB | addr::LOCAL),
            (remote_lb, addr::LB),
            (unmapped, addr::LB | addr::UNMAPPED),
            (pod, addr::POD | addr::LOCAL | addr::FILTERED),
        ]);
        let slot = |k: &IpKey| prefilter::slot(k.fold());
        for k in [local_lb, remote_lb, unmapped, pod] {
            assert!(set(&bits.all.words, slot(&k)));
        }
        assert!(set(&bits.pods.words, slot(&pod)));
        assert!(!set(&bits.pods.words, slot(&local_lb)));
        assert!(set(&bits.foreign_lbs.words, slot(&remote_lb)));
        assert!(set(&bits.foreign_lbs.words, slot(&unmapped)));
        assert!(!set(&bits.foreign_lbs.words, slot(&local_lb)));
        assert!(!set(&bits.foreign_lbs.words, slot(&pod)));
    }
}
