//! A node's way back to its first-choice controller: while a session runs
//! on another replica, the first choice is asked again now and then, and
//! the session ends (between messages) once it answers.

use std::time::Duration;

use weft_proto::v1 as pb;

use super::client;
use crate::identity::Credentials;

/// A random duration below `within`.
pub(crate) fn jitter(within: Duration) -> Duration {
    let mut b = [0u8; 4];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    within.mul_f64(f64::from(u32::from_le_bytes(b)) / (f64::from(u32::MAX) + 1.0))
}

/// Resolves once `preferred` answers an agent's call (this agent's
/// certificate, `GetTrust`) again, asked every `after` plus up to twice
/// that at random (so the agents of a replica that returns come back over
/// a while, not at once); never when there is none.
pub(super) async fn preferred_back(preferred: Option<&str>, creds: &Credentials, after: Duration) {
    let Some(url) = preferred else {
        return std::future::pending().await;
    };
    loop {
        tokio::time::sleep(after + jitter(after * 2)).await;
        let asked = tokio::time::timeout(Duration::from_secs(5), async {
            let mut c = client(url, creds).await.ok()?;
            c.get_trust(pb::GetTrustRequest {}).await.ok()
        })
        .await;
        if matches!(asked, Ok(Some(_))) {
            return;
        }
    }
}
