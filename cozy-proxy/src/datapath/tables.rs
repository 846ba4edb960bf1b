//! The datapath's tables, declared once (`datapath_tables!` in
//! `state.rs`): the declaration generates [`DatapathState`], [`StateDiff`],
//! their sizes, diff, merge and apply. A backend reads a state back by
//! building a `DatapathState` literal and writes a diff by destructuring a
//! `StateDiff` whole, so a table added here and forgotten there does not
//! compile.
//!
//! [`DatapathState`]: super::DatapathState
//! [`StateDiff`]: super::StateDiff
use std::collections::{BTreeMap, BTreeSet};

/// A collection of the state: a set of elements, or a map whose entries
/// are its elements (a changed value is an entry removed and added).
pub trait StateTable {
    type Elem;
    /// What turns `self` into `target`.
    fn change_to(&self, target: &Self) -> Change<Self::Elem>;
    /// Applies `c` as a kernel would: removing an element that is not
    /// there fails, naming the table.
    fn apply_change(
        &mut self,
        c: &Change<Self::Elem>,
        name: &'static str,
    ) -> Result<(), &'static str>;
    fn count(&self) -> usize;
    /// Takes in `other`'s elements (an entry of `other` wins).
    fn take_in(&mut self, other: Self);
}

impl<T: Ord + Clone> StateTable for BTreeSet<T> {
    type Elem = T;

    fn change_to(&self, target: &Self) -> Change<T> {
        Change::of_sets(self, target)
    }

    fn apply_change(&mut self, c: &Change<T>, name: &'static str) -> Result<(), &'static str> {
        for e in &c.remove {
            self.remove(e).then_some(()).ok_or(name)?;
        }
        self.extend(c.add.iter().cloned());
        Ok(())
    }

    fn count(&self) -> usize {
        self.len()
    }

    fn take_in(&mut self, other: Self) {
        self.extend(other);
    }
}

impl<K: Ord + Clone, V: Ord + Clone> StateTable for BTreeMap<K, V> {
    type Elem = (K, V);

    fn change_to(&self, target: &Self) -> Change<(K, V)> {
        Change::of_maps(self, target)
    }

    fn apply_change(&mut self, c: &Change<(K, V)>, name: &'static str) -> Result<(), &'static str> {
        for (k, _) in &c.remove {
            self.remove(k).ok_or(name)?;
        }
        self.extend(c.add.iter().cloned());
        Ok(())
    }

    fn count(&self) -> usize {
        self.len()
    }

    fn take_in(&mut self, other: Self) {
        self.extend(other);
    }
}

/// Declares the tables in three groups: `held` (from the plan, held by
/// every backend), `resolved` (from the kernel's paths, held too) and
/// `planned` (planned only, never held by a kernel nor serialized).
macro_rules! datapath_tables {
    (
        held { $( $(#[$hattr:meta])* $held:ident: $hty:ty, )* }
        resolved { $( $(#[$rattr:meta])* $res:ident: $rty:ty, )* }
        planned { $( $(#[$pattr:meta])* $plan:ident: $pty:ty, )* }
    ) => {
        #[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct DatapathState {
            $( $(#[$hattr])* pub $held: $hty, )*
            $( $(#[$rattr])* pub $res: $rty, )*
            $( $(#[$pattr])* #[serde(skip)] pub $plan: $pty, )*
        }

        /// What changes in each table: see [`DatapathState`]'s fields.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct StateDiff {
            $( pub $held: Change<<$hty as StateTable>::Elem>, )*
            $( pub $res: Change<<$rty as StateTable>::Elem>, )*
            $(
                #[doc = "Planned only: no backend writes it."]
                pub $plan: Change<<$pty as StateTable>::Elem>,
            )*
        }

        impl DatapathState {
            /// Number of elements over the tables a backend holds.
            pub fn len(&self) -> usize {
                0 $( + self.$held.count() )* $( + self.$res.count() )*
            }

            /// Applies `diff` as a kernel would: removing an element that
            /// is not there fails (naming its table), and so does the step.
            pub fn apply(&mut self, diff: &StateDiff) -> Result<(), &'static str> {
                $( self.$held.apply_change(&diff.$held, stringify!($held))?; )*
                $( self.$plan.apply_change(&diff.$plan, stringify!($plan))?; )*
                self.apply_resolved(diff)
            }

            /// Applies the resolved tables of `diff` alone, as
            /// [`DatapathState::apply`] does.
            pub fn apply_resolved(&mut self, diff: &StateDiff) -> Result<(), &'static str> {
                $( self.$res.apply_change(&diff.$res, stringify!($res))?; )*
                Ok(())
            }

            /// Takes in every table of `other` (states read apart, one
            /// per family, made one).
            pub fn merge(&mut self, other: DatapathState) {
                $( self.$held.take_in(other.$held); )*
                $( self.$res.take_in(other.$res); )*
                $( self.$plan.take_in(other.$plan); )*
            }

            /// What turns `self` into `target`.
            pub fn diff(&self, target: &DatapathState) -> StateDiff {
                StateDiff {
                    $( $held: self.$held.change_to(&target.$held), )*
                    $( $res: self.$res.change_to(&target.$res), )*
                    $( $plan: self.$plan.change_to(&target.$plan), )*
                }
            }
        }

        impl StateDiff {
            /// Elements removed plus elements added.
            pub fn size(&self) -> usize {
                0 $( + self.$held.size() )* $( + self.$res.size() )* $( + self.$plan.size() )*
            }
        }
    };
}

pub(crate) use datapath_tables;

/// Elements to remove and to add in one collection. A map entry whose value
/// changes is removed and added again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change<T> {
    pub remove: Vec<T>,
    pub add: Vec<T>,
}

impl<T> Default for Change<T> {
    fn default() -> Self {
        Change {
            remove: Vec::new(),
            add: Vec::new(),
        }
    }
}

impl<T: Ord + Clone> Change<T> {
    pub fn of_sets(old: &BTreeSet<T>, new: &BTreeSet<T>) -> Self {
        Change {
            remove: old.difference(new).cloned().collect(),
            add: new.difference(old).cloned().collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// The elements added (`add`) or removed.
    pub fn side(&self, add: bool) -> &[T] {
        if add {
            &self.add
        } else {
            &self.remove
        }
    }

    /// Every element removed or added.
    pub fn elements(&self) -> impl Iterator<Item = &T> {
        self.remove.iter().chain(&self.add)
    }

    pub fn size(&self) -> usize {
        self.remove.len() + self.add.len()
    }
}

impl<K: Ord + Clone, V: Ord + Clone> Change<(K, V)> {
    pub fn of_maps(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> Self {
        let changed = |a: &BTreeMap<K, V>, b: &BTreeMap<K, V>| -> Vec<(K, V)> {
            a.iter()
                .filter(|(k, v)| b.get(k) != Some(v))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        Change {
            remove: changed(old, new),
            add: changed(new, old),
        }
    }
}
