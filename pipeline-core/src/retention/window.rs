//! How long rows are kept: a duration written the human way (`90s`, `15m`, `7d`), and the
//! floor a window may not go below where less would break a guarantee.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A retention window: rows older than this are removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Window(pub Duration);

impl Window {
    /// A window of `secs` seconds.
    pub const fn secs(secs: u64) -> Self {
        Window(Duration::from_secs(secs))
    }

    /// A window of `days` days.
    pub const fn days(days: u64) -> Self {
        Window(Duration::from_secs(days * 86_400))
    }

    /// The window as a duration.
    pub fn duration(self) -> Duration {
        self.0
    }

    /// The window as a `chrono` duration, for cutoffs.
    pub fn chrono(self) -> chrono::Duration {
        chrono::Duration::from_std(self.0).unwrap_or(chrono::Duration::MAX)
    }

    /// `Err` when this window, set by `setting`, is below `floor`.
    pub fn at_least(self, setting: &str, floor: Window, why: &str) -> Result<Window, BelowFloor> {
        if self < floor {
            Err(BelowFloor {
                setting: setting.to_owned(),
                value: self,
                floor,
                why: why.to_owned(),
            })
        } else {
            Ok(self)
        }
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The largest unit that divides it: 7d, 36h, 90m, 45s (humantime's own form spells a
        // year of days as months).
        let secs = self.0.as_secs();
        match secs {
            0 => write!(f, "0s"),
            s if s % 86_400 == 0 => write!(f, "{}d", s / 86_400),
            s if s % 3_600 == 0 => write!(f, "{}h", s / 3_600),
            s if s % 60 == 0 => write!(f, "{}m", s / 60),
            s => write!(f, "{s}s"),
        }
    }
}

impl FromStr for Window {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        humantime::parse_duration(s.trim())
            .map(Window)
            .map_err(|e| format!("`{s}` is not a duration such as 90s, 15m, 12h or 7d: {e}"))
    }
}

/// A window set below its floor.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{setting} is {value}, below its floor of {floor}: {why}")]
pub struct BelowFloor {
    /// The setting's name (its flag).
    pub setting: String,
    /// What it was set to.
    pub value: Window,
    /// The least it may be.
    pub floor: Window,
    /// What a lower value would break.
    pub why: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_human_durations_and_refuses_others() {
        assert_eq!("7d".parse::<Window>().expect("parses"), Window::days(7));
        assert_eq!("90s".parse::<Window>().expect("parses"), Window::secs(90));
        assert_eq!(
            " 15m ".parse::<Window>().expect("parses"),
            Window::secs(900)
        );
        assert!("7".parse::<Window>().is_err());
        assert!("-1d".parse::<Window>().is_err());
        assert!("forever".parse::<Window>().is_err());
        assert_eq!(Window::days(365).to_string(), "365d");
        assert_eq!(Window::secs(5_400).to_string(), "90m");
        assert_eq!(Window::secs(61).to_string(), "61s");
    }

    #[test]
    fn a_window_below_its_floor_is_refused_with_the_reason() {
        let e = Window::secs(30)
            .at_least("--retain-dedupe", Window::secs(60), "why")
            .expect_err("below the floor");
        assert_eq!(
            e.to_string(),
            "--retain-dedupe is 30s, below its floor of 1m: why"
        );
        assert!(Window::secs(60)
            .at_least("--retain-dedupe", Window::secs(60), "why")
            .is_ok());
    }
}
