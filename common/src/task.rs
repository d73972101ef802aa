//! Background tasks that never die silently: each runs under a supervisor
//! that logs how it ended and then restarts it (after a backoff) or stops
//! the process with a message that says which task failed and why.

use std::future::Future;
use std::time::Duration;

/// What the supervisor does when the task ends with an error or panics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Log it and start the task again, after 1 s doubling to 60 s.
    Restart,
    /// Log it and end the process (exit status 1): the process is no use
    /// without the task, and its supervisor (systemd) restarts it whole.
    Exit,
}

/// Spawns `make()` on the runtime under a supervisor. A task that returns
/// `Ok(())` has finished its work and is not restarted. Aborting the
/// returned handle aborts the task too.
pub fn supervise<F, Fut>(name: &'static str, on_failure: OnFailure, make: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut delays = crate::backoff();
        loop {
            // Aborting the supervisor aborts the task it runs.
            let mut run = AbortOnDrop(tokio::spawn(make()));
            let why = match (&mut run.0).await {
                Ok(Ok(())) => {
                    tracing::debug!(task = name, "background task finished");
                    return;
                }
                Ok(Err(e)) => format!("{e:#}"),
                Err(e) if e.is_panic() => format!("panicked: {}", panic_text(e.into_panic())),
                Err(_) => return, // cancelled: the runtime is shutting down
            };
            match on_failure {
                OnFailure::Restart => {
                    let wait = delays.next().unwrap_or(Duration::from_secs(60));
                    tracing::error!(task = name, error = %why, retry_in = ?wait, "background task failed; restarting it");
                    tokio::time::sleep(wait).await;
                }
                OnFailure::Exit => {
                    tracing::error!(task = name, error = %why, "background task failed; stopping");
                    eprintln!("weft: background task {name} failed: {why}; stopping");
                    std::process::exit(1);
                }
            }
        }
    })
}

/// Aborts the task it holds when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Spawns `fut`, a task the process cannot do without and that holds state
/// no restart could rebuild: if it panics, the process stops with a message
/// naming it. Aborting the returned handle aborts the task.
pub fn spawn_critical<F>(name: &'static str, fut: F) -> tokio::task::JoinHandle<()>
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut inner = AbortOnDrop(tokio::spawn(fut));
    tokio::spawn(async move {
        match (&mut inner.0).await {
            Ok(()) => tracing::debug!(task = name, "background task finished"),
            Err(e) if e.is_panic() => {
                let why = panic_text(e.into_panic());
                tracing::error!(task = name, error = %why, "background task panicked; stopping");
                eprintln!("weft: background task {name} panicked: {why}; stopping");
                std::process::exit(1);
            }
            Err(_) => {}
        }
    })
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_failing_task_is_restarted_and_a_panicking_one_too() {
        let runs = Arc::new(AtomicU32::new(0));
        let r = runs.clone();
        let h = supervise("flaky", OnFailure::Restart, move || {
            let r = r.clone();
            async move {
                match r.fetch_add(1, Ordering::SeqCst) {
                    0 => anyhow::bail!("first run fails"),
                    1 => panic!("second run panics"),
                    _ => Ok(()),
                }
            }
        });
        h.await.unwrap();
        assert_eq!(
            runs.load(Ordering::SeqCst),
            3,
            "ran again after the error and after the panic"
        );
    }

    #[tokio::test]
    async fn aborting_a_critical_task_aborts_what_it_runs() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let h = spawn_critical("forever", async move {
            let _tx = tx; // dropped when the task is
            std::future::pending::<()>().await
        });
        h.abort();
        assert!(rx.await.is_err(), "the inner task was dropped");
    }

    #[tokio::test]
    async fn aborting_a_supervisor_aborts_the_task_it_runs() {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let tx = std::sync::Mutex::new(Some(tx));
        let h = supervise("forever", OnFailure::Restart, move || {
            let held = tx.lock().unwrap().take();
            async move {
                let _held = held; // dropped when the task is
                std::future::pending::<anyhow::Result<()>>().await
            }
        });
        tokio::task::yield_now().await;
        h.abort();
        let dropped = tokio::time::timeout(std::time::Duration::from_secs(5), rx).await;
        assert!(matches!(dropped, Ok(Err(_))), "the supervised task was dropped");
    }
}
