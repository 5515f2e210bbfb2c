//! When `ferry up` restarts a process it supervises, as pure decisions over plain data (no
//! processes, no clock: the caller passes how long the process ran).
//!
//! The policy is Kubernetes' `restartPolicy: OnFailure` with its crash-loop backoff, shortened
//! for one machine: a process that died of a signal or exited non-zero is restarted after 0.5 s,
//! doubling to at most 10 s while it keeps failing, back to 0.5 s once it has stayed up 30 s.
//! A clean exit (status 0) is a process that chose to leave (a worker that drained after someone
//! sent it SIGTERM), and one `ferry up` told to stop (scale-down, shutdown) is never restarted.

use std::time::Duration;

/// How a child process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Exit status 0.
    Clean,
    /// A non-zero exit status (a worker whose engine broke exits 70).
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Exit {
    pub fn of(status: std::process::ExitStatus) -> Exit {
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(sig) = status.signal() {
                return Exit::Signal(sig);
            }
        }
        match status.code() {
            Some(0) => Exit::Clean,
            Some(c) => Exit::Code(c),
            // Neither a code nor a signal: only possible off unix; count it as a failure.
            None => Exit::Code(-1),
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Clean => f.write_str("exit status 0"),
            Exit::Code(c) => write!(f, "exit status {c}"),
            Exit::Signal(s) => match signal_name(*s) {
                Some(name) => write!(f, "signal {s}, {name}"),
                None => write!(f, "signal {s}"),
            },
        }
    }
}

fn signal_name(sig: i32) -> Option<&'static str> {
    Some(match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        6 => "SIGABRT",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        15 => "SIGTERM",
        _ => return None,
    })
}

/// What to do about a process that exited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Start it again (after the backoff).
    Restart,
    /// `ferry up` asked it to stop (scale-down or shutdown): it is done.
    Stopped,
    /// It left on its own with status 0: not restarted.
    LeftCleanly,
    /// It failed, but restarts are off (`--no-restart`).
    StaysDown,
}

pub fn decide(exit: Exit, told_to_stop: bool, restarts_on: bool) -> Decision {
    match (told_to_stop, exit, restarts_on) {
        (true, _, _) => Decision::Stopped,
        (false, Exit::Clean, _) => Decision::LeftCleanly,
        (false, Exit::Code(_) | Exit::Signal(_), true) => Decision::Restart,
        (false, Exit::Code(_) | Exit::Signal(_), false) => Decision::StaysDown,
    }
}

/// Exponential restart delays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub initial: Duration,
    pub max: Duration,
    /// A process that ran at least this long before it failed starts over at `initial`.
    pub stable: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> BackoffPolicy {
        BackoffPolicy { initial: Duration::from_millis(500), max: Duration::from_secs(10), stable: Duration::from_secs(30) }
    }
}

/// One process's backoff state.
#[derive(Clone, Debug)]
pub struct Backoff {
    policy: BackoffPolicy,
    next: Duration,
}

impl Backoff {
    pub fn new(policy: BackoffPolicy) -> Backoff {
        Backoff { policy, next: policy.initial }
    }

    /// The process failed after running for `uptime`: how long to wait before starting it again.
    pub fn delay(&mut self, uptime: Duration) -> Duration {
        if uptime >= self.policy.stable {
            self.next = self.policy.initial;
        }
        let d = self.next;
        self.next = (self.next * 2).min(self.policy.max);
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions() {
        use Decision::*;
        let cases = [
            (Exit::Signal(9), false, true, Restart),
            (Exit::Code(70), false, true, Restart),
            (Exit::Code(1), false, true, Restart),
            (Exit::Clean, false, true, LeftCleanly),
            (Exit::Signal(9), false, false, StaysDown),
            (Exit::Code(70), false, false, StaysDown),
            (Exit::Clean, false, false, LeftCleanly),
            (Exit::Clean, true, true, Stopped),
            (Exit::Signal(15), true, true, Stopped),
            (Exit::Signal(9), true, false, Stopped),
        ];
        for (exit, told, on, want) in cases {
            assert_eq!(decide(exit, told, on), want, "{exit:?} told_to_stop={told} restarts_on={on}");
        }
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_resets_after_a_stable_run() {
        let mut b = Backoff::new(BackoffPolicy::default());
        let ms = |n| Duration::from_millis(n);
        let quick = ms(100);
        let got: Vec<Duration> = (0..7).map(|_| b.delay(quick)).collect();
        assert_eq!(got, [ms(500), ms(1000), ms(2000), ms(4000), ms(8000), ms(10_000), ms(10_000)]);
        // Up for 30 s: back to the start, then doubling again.
        assert_eq!(b.delay(Duration::from_secs(30)), ms(500));
        assert_eq!(b.delay(quick), ms(1000));
        assert_eq!(b.delay(Duration::from_secs(29)), ms(2000));
    }

    #[test]
    fn exits_read_as_operators_expect() {
        assert_eq!(Exit::Signal(9).to_string(), "signal 9, SIGKILL");
        assert_eq!(Exit::Signal(42).to_string(), "signal 42");
        assert_eq!(Exit::Code(70).to_string(), "exit status 70");
        assert_eq!(Exit::Clean.to_string(), "exit status 0");
    }

    #[cfg(unix)]
    #[test]
    fn exit_of_a_status() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(Exit::of(std::process::ExitStatus::from_raw(9)), Exit::Signal(9));
        assert_eq!(Exit::of(std::process::ExitStatus::from_raw(70 << 8)), Exit::Code(70));
        assert_eq!(Exit::of(std::process::ExitStatus::from_raw(0)), Exit::Clean);
    }
}
