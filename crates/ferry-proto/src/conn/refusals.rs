//! [`RefusalLog`]: at most one log line a second for a burst of like events (refused
//! connections, accept errors), carrying how many happened since the last line; the events held
//! back at a burst's end are flushed a second later ([`RefusalLog::flush`]). Pure: the caller
//! passes the time.

use std::time::{Duration, Instant};

/// The least time between two lines.
const EVERY: Duration = Duration::from_secs(1);

/// Counts events and says when one should be logged.
#[derive(Debug, Default)]
pub struct RefusalLog {
    last: Option<Instant>,
    since: u64,
}

impl RefusalLog {
    /// Notes one event at `now`: `Some(n)` when a line is due, `n` the events since the last line
    /// (this one included); `None` while the last line is less than a second old.
    pub fn note(&mut self, now: Instant) -> Option<u64> {
        self.since += 1;
        match self.last {
            Some(t) if now.saturating_duration_since(t) < EVERY => None,
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.since))
            }
        }
    }

    /// When the events held back since the last line are due to be logged (none held: `None`).
    pub fn due(&self) -> Option<Instant> {
        (self.since > 0).then(|| self.last.map_or_else(Instant::now, |t| t + EVERY))
    }

    /// The events held back, to be logged now (`None` when none are, or the last line is less
    /// than a second old).
    pub fn flush(&mut self, now: Instant) -> Option<u64> {
        match self.due() {
            Some(t) if now >= t => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.since))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_with_the_count_since() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut log = RefusalLog::default();
        let got: Vec<Option<u64>> = [0, 10, 500, 999, 1000, 1001, 2500].into_iter().map(|t| log.note(ms(t))).collect();
        // The first is logged at once; the next three wait; the fifth carries them (4 since).
        assert_eq!(got, vec![Some(1), None, None, None, Some(4), None, Some(2)]);
    }

    #[test]
    fn a_bursts_tail_is_flushed_a_second_after_the_last_line() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut log = RefusalLog::default();
        assert_eq!((log.due(), log.flush(ms(0))), (None, None));
        assert_eq!(log.note(ms(0)), Some(1));
        assert_eq!(log.due(), None, "nothing held back");
        for t in [1, 2, 3] {
            assert_eq!(log.note(ms(t)), None);
        }
        assert_eq!(log.due(), Some(ms(1000)));
        assert_eq!(log.flush(ms(999)), None);
        assert_eq!(log.flush(ms(1000)), Some(3));
        assert_eq!((log.due(), log.flush(ms(5000))), (None, None));
    }
}
