//! What the sync layer believes the kernel holds, and the transitions
//! between beliefs. The rule kept: from the moment a sync starts until it
//! succeeds, the belief is [`Known::Unread`]. A failure anywhere in a sync
//! (a read, the paths, a write) thus leaves the next sync reading the
//! kernel, with no error path having to say so; only a success, or an
//! event from outside (a resync, someone else's change), sets a belief.
use crate::datapath::{Capacity, DatapathState, Entries};

/// What the kernel holds. One copy of the state in the usual case, never
/// a second kept or cloned at a full sync: the state is a large part of
/// the controller's memory.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) enum Known {
    /// Not known (before the first sync, during one, after a failure,
    /// after a resync or someone else's change): the next sync reads the
    /// kernel.
    #[default]
    Unread,
    /// `planned`, guards and routes included, with nothing left out for
    /// lack of room; `needs`: what it needs of the tables.
    Planned { needs: Entries },
    /// Another state: what the tables could hold of `planned`.
    State(Box<DatapathState>),
}

/// How a change is synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Way {
    /// Only the addresses the change touches are resolved and compared:
    /// O(the change). What the state needs of the tables once changed.
    Incremental(Entries),
    /// Every address resolved and compared, from what the kernel holds.
    Full,
}

impl Known {
    /// The way to sync a change that adds and removes these entries:
    /// incremental only when the kernel holds `planned` as it was before
    /// the change (nothing left out) and the changed state fits
    /// `capacity`. Anything else takes the full way, which fits the state
    /// again and takes back what now fits.
    pub(super) fn way(&self, added: Entries, removed: Entries, capacity: &Capacity) -> Way {
        match self {
            Known::Planned { needs } => {
                let changed = needs.plus(added).minus(removed);
                match changed.fits(capacity) {
                    true => Way::Incremental(changed),
                    false => Way::Full,
                }
            }
            _ => Way::Full,
        }
    }

    /// Starts a sync toward a new `planned`: what the kernel holds
    /// (`None`: to be read), taken out. When the kernel holds `planned`
    /// itself, `planned` is moved out: the caller replaces it.
    pub(super) fn start(&mut self, planned: &mut DatapathState) -> Option<DatapathState> {
        match std::mem::take(self) {
            Known::Unread => None,
            Known::Planned { .. } => Some(std::mem::take(planned)),
            Known::State(s) => Some(*s),
        }
    }

    /// Starts a sync of a change the way `way` says, before `planned`
    /// changes in place: what the kernel holds for the full way (a copy
    /// of `planned` when it holds that); `None` for the incremental way,
    /// whose change says what the kernel holds, and for a full way that
    /// is to read the kernel.
    pub(super) fn start_change(
        &mut self,
        way: Way,
        planned: &DatapathState,
    ) -> Option<DatapathState> {
        match (way, std::mem::take(self)) {
            (Way::Incremental(_), _) | (Way::Full, Known::Unread) => None,
            (Way::Full, Known::Planned { .. }) => Some(planned.clone()),
            (Way::Full, Known::State(s)) => Some(*s),
        }
    }

    /// The belief after a sync that wrote its target: `planned`
    /// (`fitted`: `None`), needing `needs` of the tables, or what the
    /// tables could hold of it. `complete` false: the parts of a fresh
    /// install did not make the whole, and the kernel is to be read.
    pub(super) fn written(fitted: Option<DatapathState>, complete: bool, needs: Entries) -> Known {
        match fitted {
            _ if !complete => Known::Unread,
            Some(f) => Known::State(Box::new(f)),
            None => Known::Planned { needs },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn state(pod: &str) -> DatapathState {
        DatapathState {
            filtered_pods: BTreeSet::from([pod.parse().expect("test address")]),
            ..Default::default()
        }
    }

    /// A plan held needing 2 addresses (and nothing else).
    const NEEDS: Entries = Entries::new(2, 0, 0, 0);

    fn known(name: &str) -> Known {
        match name {
            "Unread" => Known::Unread,
            "Planned" => Known::Planned { needs: NEEDS },
            _ => Known::State(Box::new(state("192.0.2.99"))),
        }
    }

    /// Incremental only from `Planned` (nothing left out), with a changed
    /// state that fits; it carries what the changed state needs.
    #[test]
    fn only_a_known_plan_with_room_takes_the_incremental_way() {
        use Way::*;
        let (one, two) = (Entries::new(1, 0, 0, 0), Entries::new(2, 0, 0, 0));
        let cap = |addresses| Entries::new(addresses, 10, 10, 10);
        let table = [
            // belief, added, removed, addresses the tables hold, way
            (
                "Planned",
                one,
                Entries::default(),
                3,
                Incremental(Entries::new(3, 0, 0, 0)),
            ),
            (
                "Planned",
                two,
                one,
                3,
                Incremental(Entries::new(3, 0, 0, 0)),
            ),
            ("Planned", two, Entries::default(), 3, Full),
            (
                "Planned",
                Entries::default(),
                two,
                0,
                Incremental(Entries::default()),
            ),
            ("State", Entries::default(), Entries::default(), 3, Full),
            ("Unread", Entries::default(), Entries::default(), 3, Full),
        ];
        for (belief, added, removed, room, way) in table {
            let got = known(belief).way(added, removed, &cap(room));
            assert_eq!(got, way, "{belief} +{added:?} -{removed:?} in {room}");
        }
    }

    /// Every start leaves `Unread` behind, whatever it takes out.
    #[test]
    fn a_started_sync_believes_nothing_until_it_succeeds() {
        let plan = state("192.0.2.1");
        for belief in ["Unread", "Planned", "State"] {
            let held_state = matches!(known(belief), Known::State(_)).then(|| state("192.0.2.99"));
            let held_plan = (belief == "Planned").then(|| plan.clone());
            let expected = held_state.or(held_plan);
            // Toward a new plan: the plan held is moved out.
            let (mut k, mut planned) = (known(belief), plan.clone());
            assert_eq!(k.start(&mut planned), expected, "{belief}");
            assert_eq!(k, Known::Unread);
            if belief == "Planned" {
                assert_eq!(planned, DatapathState::default());
            }
            // A change the full way: the plan held is copied.
            let mut k = known(belief);
            assert_eq!(k.start_change(Way::Full, &plan), expected, "{belief}");
            assert_eq!(k, Known::Unread);
            // The incremental way takes nothing out.
            let mut k = known(belief);
            assert_eq!(k.start_change(Way::Incremental(NEEDS), &plan), None);
            assert_eq!(k, Known::Unread);
        }
    }

    #[test]
    fn a_written_target_is_believed_unless_the_parts_fell_short() {
        assert_eq!(
            Known::written(None, true, NEEDS),
            Known::Planned { needs: NEEDS }
        );
        let fitted = state("192.0.2.2");
        assert_eq!(
            Known::written(Some(fitted.clone()), true, NEEDS),
            Known::State(Box::new(fitted.clone()))
        );
        assert_eq!(Known::written(None, false, NEEDS), Known::Unread);
        assert_eq!(Known::written(Some(fitted), false, NEEDS), Known::Unread);
    }
}
