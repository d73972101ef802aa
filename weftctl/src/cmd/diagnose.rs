//! `weftctl diagnose`: every check, what failed and what to do.

use std::time::Duration;

use serde_json::json;
use weft_proto::v1 as pb;

use crate::out::*;

pub(crate) fn result_name(v: i32) -> &'static str {
    match pb::CheckResult::try_from(v).unwrap_or_default() {
        pb::CheckResult::Pass => "PASS",
        pb::CheckResult::Warn => "WARN",
        pb::CheckResult::Fail => "FAIL",
        pb::CheckResult::Unspecified => "?",
    }
}

/// `weftctl diagnose`: every check, what failed and what to do. The report
/// is printed whole whatever the results; the exit status is 1 when a
/// check FAILs (WARNs do not count), and the failed checks are then also
/// named on stderr, so a script that keeps only stderr still sees why.
/// (When the controller cannot be asked, nothing is printed and the exit
/// status is 2: see `main`.)
pub async fn run(c: &mut Client, settle: Duration) -> Result<Out, String> {
    let r = c
        .diagnose(pb::DiagnoseRequest {
            settle_millis: settle.as_millis().min(60_000) as u32,
        })
        .await
        .map_err(status)?
        .into_inner();
    let mut rows = Vec::new();
    let count = |k: pb::CheckResult| r.checks.iter().filter(|c| c.result == k as i32).count();
    for ch in &r.checks {
        rows.push(vec![
            result_name(ch.result).into(),
            ch.check.clone(),
            ch.subject.clone(),
            ch.detail.clone(),
        ]);
        if !ch.hint.is_empty() && ch.result != pb::CheckResult::Pass as i32 {
            rows.push(vec![
                String::new(),
                String::new(),
                String::new(),
                format!("→ {}", ch.hint),
            ]);
        }
    }
    let (pass, warn, fail) = (
        count(pb::CheckResult::Pass),
        count(pb::CheckResult::Warn),
        count(pb::CheckResult::Fail),
    );
    if fail > 0 {
        let failed: Vec<String> = r
            .checks
            .iter()
            .filter(|c| c.result == pb::CheckResult::Fail as i32)
            .map(|c| format!("{} {}: {}", c.check, c.subject, c.detail))
            .collect();
        eprintln!(
            "weftctl: diagnose: {fail} of {} checks failed: {}",
            r.checks.len(),
            failed.join("; ")
        );
    }
    Ok(Out {
        failed: fail > 0,
        json: json!({"checks": r.checks.iter().map(|c| json!({"result": result_name(c.result), "check": c.check,
            "subject": c.subject, "detail": c.detail, "hint": c.hint})).collect::<Vec<_>>(),
            "pass": pass, "warn": warn, "fail": fail}),
        header: vec!["RESULT", "CHECK", "SUBJECT", "DETAIL"],
        rows,
        footer: vec![format!(
            "\n{} checks: {pass} pass, {warn} warn, {fail} fail",
            r.checks.len()
        )],
    })
}
