//! A session's reports: on one `ReportStream` (or as `Report` calls to an
//! older controller), the controller's answers, and the heartbeats a task
//! sends while the session's loop is busy.

use std::time::Duration;

use weft_proto::v1 as pb;
use weft_proto::v1::agent_service_client::AgentServiceClient;

use super::{End, classify};

/// How often the controller wants a report.
pub(super) fn heartbeat_period(r: &pb::ReportResponse) -> Duration {
    if r.heartbeat_millis > 0 {
        Duration::from_millis(u64::from(r.heartbeat_millis.max(50)))
    } else {
        Duration::from_secs(u64::from(r.heartbeat_seconds.max(1)))
    }
}

/// What the session's last report said, for [`keep_reporting`].
pub(super) struct LastReport {
    pub(super) at: std::time::Instant,
    pub(super) report: pb::ReportRequest,
    pub(super) every: Duration,
    pub(super) reporter: Reporter,
}

impl LastReport {
    /// `report` was just sent through `reporter`: the keeper repeats it
    /// (without the host's facts) if the loop is busy when the next is due.
    pub(super) fn remember(&mut self, report: &pb::ReportRequest, reporter: &Reporter) {
        self.at = std::time::Instant::now();
        self.report = pb::ReportRequest {
            host: None,
            ..report.clone()
        };
        self.reporter = reporter.clone();
    }
}

/// Where the session's reports go: messages on one long-lived
/// `ReportStream` (a heartbeat is then one small frame, not a call), or
/// `Report` calls to a controller that has no such stream.
#[derive(Clone)]
pub(super) enum Reporter {
    Stream(tokio::sync::mpsc::Sender<pb::ReportRequest>),
    Calls(AgentServiceClient<tonic::transport::Channel>),
}

/// The controller's answers on a report stream (None: reports are calls).
pub(super) type Answers = Option<tonic::Streaming<pb::ReportResponse>>;

impl Reporter {
    /// Opens the report stream on `c` (calls, if the controller has none).
    pub(super) async fn open(
        c: &mut AgentServiceClient<tonic::transport::Channel>,
    ) -> Result<(Reporter, Answers), End> {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        match c.report_stream(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
            Ok(a) => Ok((Reporter::Stream(tx), Some(a.into_inner()))),
            Err(s) if s.code() == tonic::Code::Unimplemented => Ok((Reporter::Calls(c.clone()), None)),
            Err(s) => Err(classify(s)),
        }
    }

    /// Sends one report. A call's answer comes back here; a stream's
    /// answers come on its [`Answers`]. Err: the stream has ended (its
    /// answers say why) or the call was refused.
    pub(super) async fn send(
        &mut self,
        r: pb::ReportRequest,
    ) -> Result<Option<pb::ReportResponse>, Option<tonic::Status>> {
        match self {
            Reporter::Stream(tx) => tx.send(r).await.map(|_| None).map_err(|_| None),
            Reporter::Calls(c) => c.report(r).await.map(|a| Some(a.into_inner())).map_err(Some),
        }
    }
}

/// The next answer on a report stream; never, when reports are calls.
pub(super) async fn next_answer(answers: &mut Answers) -> Result<Option<pb::ReportResponse>, tonic::Status> {
    match answers {
        Some(a) => a.message().await,
        None => std::future::pending().await,
    }
}

/// Why a report stream ended, from its answers (waited for briefly: the
/// status comes right after the stream stops taking reports).
pub(super) async fn stream_end(answers: &mut Answers) -> End {
    loop {
        match tokio::time::timeout(Duration::from_secs(2), next_answer(answers)).await {
            Ok(Ok(Some(_))) => continue,
            Ok(Ok(None)) => return End::Transient(anyhow::anyhow!("the controller ended the report stream")),
            Ok(Err(s)) => return classify(s),
            Err(_) => return End::Lost(anyhow::anyhow!("the report stream stopped without a status")),
        }
    }
}

/// Reports again what the session last reported whenever the session's
/// loop has not reported for one and a half heartbeat periods (half a TTL;
/// the margin keeps it from racing the loop's own heartbeat): the loop reports after
/// each change, but while it is busy (a reconcile that takes long on a
/// loaded host, a slow `nft`) its heartbeats would stop, and a gateway
/// not heard for its TTL (800 ms by default) is failed over although it
/// works. Liveness must not depend on how long a reconcile takes.
pub(super) async fn keep_reporting(last: std::sync::Arc<std::sync::Mutex<LastReport>>) {
    loop {
        let (wait, due) = {
            let l = last.lock().unwrap();
            let since = l.at.elapsed();
            let late = l.every + l.every / 2;
            if since >= late {
                (l.every, Some((l.report.clone(), l.reporter.clone())))
            } else {
                (late - since, None)
            }
        };
        if let Some((report, mut reporter)) = due {
            let busy = last.lock().unwrap().at.elapsed();
            let sent = reporter.send(report).await.is_ok();
            tracing::debug!(
                busy_ms = busy.as_millis() as u64,
                sent,
                "the session's loop is busy: its last report sent again"
            );
            if sent {
                last.lock().unwrap().at = std::time::Instant::now();
            }
        }
        tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
    }
}

/// Aborts a task when dropped (when the session ends, however it ends).
pub(super) struct AbortOnDrop(pub(super) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
