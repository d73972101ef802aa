//! A range of UDP ports (WireGuard's, a relay's).

use serde::{Deserialize, Serialize};

use super::shown;

/// A range of UDP ports, both ends included.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl Default for PortRange {
    /// 51820-51919: WireGuard's customary port and the 99 above it, so a
    /// site can peer with up to 100 sites.
    fn default() -> Self {
        PortRange {
            first: 51820,
            last: 51919,
        }
    }
}

impl PortRange {
    /// How many ports the range holds.
    pub fn count(&self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    pub fn iter(&self) -> impl Iterator<Item = u16> {
        self.first..=self.last
    }

    /// Parses `FIRST-LAST` (or a single port), or says what is wrong.
    pub fn parse(text: &str) -> Result<PortRange, String> {
        let text = text.trim();
        let (a, b) = text.split_once('-').unwrap_or((text, text));
        let port = |t: &str| t.trim().parse::<u16>().ok().filter(|p| *p != 0);
        match (port(a), port(b)) {
            (Some(first), Some(last)) if first <= last => Ok(PortRange { first, last }),
            (Some(_), Some(_)) => Err(format!("{} runs backwards; write the lower port first", shown(text))),
            _ => Err(format!(
                "{} is not a port range; write FIRST-LAST with ports from 1 to 65535, e.g. 51820-51919",
                shown(text)
            )),
        }
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}
