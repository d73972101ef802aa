//! A real node agent enrolls with a token and a pinned CA fingerprint,
//! keeps its key to itself, renews its short-lived certificate without a
//! restart, restarts from its stored identity, and stops when revoked.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use weft_tests::{Controller, ControllerSpec, Proc, bin, eventually, weftctl_json};

fn node_cert_expiry(c: &Controller, name: &str) -> Option<String> {
    let nodes = weftctl_json(&c.target(), &["nodes"]);
    nodes["nodes"]
        .as_array()?
        .iter()
        .find(|n| n["name"] == name)
        .and_then(|n| match n["cert_expires_at"].as_str() {
            Some("") | None => None,
            Some(s) => Some(s.to_string()),
        })
}

fn agent(c: &Controller, dir: &std::path::Path, extra: &[&str], log: &str) -> Proc {
    let mut cmd = Command::new(bin("weft-node-agent"));
    cmd.args([
        "--controller",
        &format!("https://127.0.0.1:{}", c.listen_port),
        "--name",
        "n1",
        "--state-dir",
    ])
    .arg(dir.join("state"))
    .args(extra)
    .arg("--dry-run")
    .env_remove("WEFT_CONTROLLER")
    .env_remove("WEFT_TOKEN");
    Proc::spawn(&mut cmd, &dir.join(log))
}

#[test]
fn node_agent_enrolls_renews_restarts_and_stops_when_revoked() {
    weft_tests::step("a controller with 10 s agent certificates");
    let dir = tempfile::Builder::new().prefix("weft-agent").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--agent-cert-ttl", "10s"])
        .start();
    let tok: Value = weftctl_json(&c.target(), &["token", "create", "--role", "node", "--name", "n1"]);
    let (token, fp) = (
        tok["token"].as_str().unwrap().to_string(),
        tok["ca_fingerprint"].as_str().unwrap().to_string(),
    );
    let secret = token.rsplit('.').next().unwrap().to_string();

    weft_tests::step("a wrong fingerprint is refused and the token survives");
    // A wrong fingerprint: refused before the token is sent, and the token survives.
    let mut wrong = agent(
        &c,
        dir.path(),
        &["--token", &token, "--ca-fingerprint", &"ab".repeat(32)],
        "wrong.log",
    );
    let st = wrong
        .wait_exit(Duration::from_secs(15))
        .expect("agent with a wrong fingerprint must exit");
    assert!(!st.success());
    assert!(wrong.log_text().contains("--ca-fingerprint"), "{}", wrong.log_text());
    assert_eq!(
        weftctl_json(&c.target(), &["token", "list"])["tokens"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    weft_tests::step("the agent enrolls and uses up the token");
    let mut a = agent(
        &c,
        dir.path(),
        &["--token", &token, "--ca-fingerprint", &fp],
        "agent.log",
    );
    let first = eventually("enrollment", Duration::from_secs(15), || node_cert_expiry(&c, "n1"));
    let key = dir.path().join("state/agent.key");
    // The controller records the enrollment before the agent has its
    // answer and writes its key and certificate.
    let meta = eventually("the agent's key on disk", Duration::from_secs(10), || {
        std::fs::metadata(&key).ok()
    });
    let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
    assert_eq!(mode & 0o777, 0o600, "the private key is for the agent alone");
    assert!(
        weftctl_json(&c.target(), &["token", "list"])["tokens"]
            .as_array()
            .unwrap()
            .is_empty(),
        "token used up"
    );

    weft_tests::step("renewal at two thirds of 10 s, with no restart");
    // Renewal at two thirds of 10 s, with no restart.
    let renewed = eventually("renewal", Duration::from_secs(20), || {
        node_cert_expiry(&c, "n1").filter(|e| *e != first)
    });
    assert!(renewed > first);
    assert!(
        a.child.is_some() && a.wait_exit(Duration::from_millis(10)).is_none(),
        "the agent kept running"
    );
    weft_tests::step("the watch stream survives the renewal");
    // ... and kept its watch stream: one "watching", no reconnect, and the
    // controller still streams to it (its latest revision is known).
    // (The controller records the new certificate before the agent has
    // stored it and said so: wait for the agent's line.)
    let log = eventually("the agent's renewal", Duration::from_secs(5), || {
        let log = a.log_text();
        log.contains("certificate renewed").then_some(log)
    });
    assert_eq!(log.matches("watching").count(), 1, "the stream was re-opened: {log}");
    let nodes = weftctl_json(&c.target(), &["nodes"]);
    let st = &nodes["nodes"][0]["status"];
    assert_eq!(st["ready"], true, "{st}");
    assert!(st["latest_revision"].as_i64() > Some(0), "no live stream: {st}");

    weft_tests::step("a restart from the stored identity");
    // Restart from the stored identity, without a token.
    assert!(a.stop().success());
    let mut a = agent(&c, dir.path(), &[], "agent2.log");
    eventually("watching after restart", Duration::from_secs(15), || {
        a.log_text().contains("watching").then_some(())
    });
    assert!(!a.log_text().contains("enrolled"), "a restart does not enroll again");

    weft_tests::step("a revoked agent stops, saying why");
    // Revocation: the agent's next renewal is refused and it stops, saying why.
    weftctl_json(&c.target(), &["node", "remove", "n1"]);
    let st = a.wait_exit(Duration::from_secs(20)).expect("a revoked agent stops");
    assert!(!st.success());
    let text = a.log_text();
    assert!(text.contains("the admin removed this agent"), "{text}");

    weft_tests::step("the token's secret never reached a log");
    // The token's secret never reached a log.
    for log in [
        c.log_text(),
        text,
        std::fs::read_to_string(dir.path().join("agent.log")).unwrap(),
    ] {
        assert!(!log.contains(&secret), "a log holds the token secret");
    }
}

/// An agent that was down when the admin removed it learns it at its first
/// call back (its certificate was revoked as removed): it removes what it
/// applied and stops, rather than asking forever.
#[test]
fn an_agent_away_at_its_removal_removes_its_objects_when_it_is_back() {
    let dir = tempfile::Builder::new().prefix("weft-agent").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("data"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let tok: Value = weftctl_json(&c.target(), &["token", "create", "--role", "node", "--name", "n1"]);
    let (token, fp) = (tok["token"].as_str().unwrap(), tok["ca_fingerprint"].as_str().unwrap());
    let mut a = agent(&c, dir.path(), &["--token", token, "--ca-fingerprint", fp], "agent.log");
    eventually("applied", Duration::from_secs(20), || {
        a.log_text().contains("applied revision=").then_some(())
    });
    assert!(a.stop().success());
    weftctl_json(&c.target(), &["node", "remove", "n1"]);
    let mut a = agent(&c, dir.path(), &[], "agent2.log");
    let st = a
        .wait_exit(Duration::from_secs(20))
        .expect("a removed agent stops when it is back");
    assert!(!st.success());
    let text = a.log_text();
    assert!(text.contains("the admin removed this agent"), "{text}");
    assert!(text.contains("removed weft's objects"), "{text}");
}

/// A Watch stream ends when the certificate it was opened with expires;
/// the agent, renewed by then, reconnects and resumes, and a gateway is
/// not taken for gone on the way (no failover, no teardown).
#[test]
fn a_watch_ends_with_its_certificate_and_the_agent_carries_on() {
    let dir = tempfile::Builder::new().prefix("weft-expiry").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("ctl"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--agent-cert-ttl", "10s"])
        .start();
    let mut gw = weft_tests::dry_run_agent("gateway", "gw", "127.0.0.1", &[&c], &c, dir.path());
    eventually("the first watch", Duration::from_secs(20), || {
        gw.log_text().contains("watching").then_some(())
    });
    // The first certificate expires 10 s after enrollment.
    let log = eventually(
        "the watch moved to the renewed certificate",
        Duration::from_secs(25),
        || {
            let log = gw.log_text();
            (log.contains("has expired; reconnect") && log.matches("watching").count() >= 2).then_some(log)
        },
    );
    assert!(
        gw.wait_exit(Duration::from_secs(2)).is_none(),
        "the agent stopped:\n{log}"
    );
    assert!(!log.contains("refused this agent"), "{log}");
    let ctl = c.log_text();
    assert!(
        !ctl.contains("gateway disconnected; no longer live"),
        "the gateway was taken for gone:\n{ctl}"
    );
    let g = weftctl_json(&c.target(), &["gateways"]);
    assert_eq!(g["gateways"][0]["status"]["ready"], true, "{g}");
}

/// A state file that cannot be saved (here something stands where its
/// temporary file goes; a full disk fails the same write) never stops the
/// agent: it takes in new desired state, keeps what it applied, reports
/// the failure and saves again once it can.
#[test]
fn a_state_file_that_cannot_be_saved_is_reported_and_retried_and_never_stops_the_agent() {
    weft_tests::step("the node agent saves and applies its desired state");
    let dir = tempfile::Builder::new().prefix("weft-enroll").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("ctl"))
        .flags(&["--pod-cidr", "10.1.0.0/16"])
        .start();
    let mut n1 = weft_tests::dry_run_agent("node", "n1", "127.0.0.1", &[&c], &c, dir.path());
    eventually("n1 watching", Duration::from_secs(20), || {
        n1.log_text().contains("watching").then_some(())
    });
    let state = dir.path().join("n1");
    let saved = || std::fs::read(state.join("desired-state.pb")).unwrap();
    // The agent's "applied" log line, one per change taken in.
    let applied = |p: &Proc| p.log_text().matches("applied revision=").count();
    // "watching" comes before the first desired state is saved and
    // applied: wait for both rather than assume them.
    let before = eventually(
        "n1 saved and applied its desired state",
        Duration::from_secs(20),
        || {
            let b = std::fs::read(state.join("desired-state.pb"))
                .ok()
                .filter(|b| !b.is_empty())?;
            (applied(&n1) > 0).then_some(b)
        },
    );
    weft_tests::step("something stands where the state file's temporary file goes");
    let applied_before = applied(&n1);
    let obstacle = state.join("desired-state.tmp");
    std::fs::create_dir(&obstacle).unwrap();
    std::fs::write(obstacle.join("x"), b"in the way").unwrap();

    weft_tests::step("a new desired state is applied and the failed save reported");
    // A gateway arrives: n1's desired state changes.
    let _gw = weft_tests::dry_run_agent("gateway", "gw", "127.0.0.2", &[&c], &c, dir.path());
    let errors = |c: &Controller| weftctl_json(&c.target(), &["node", "get", "n1"])["status"]["errors"].clone();
    let reported = eventually("n1 reports its state file", Duration::from_secs(30), || {
        let e = errors(&c);
        e.as_array()?
            .iter()
            .any(|x| {
                x.as_str()
                    .is_some_and(|s| s.contains("cannot keep the desired state on disk"))
            })
            .then_some(e)
    });
    eprintln!("reported: {reported}");
    assert!(
        applied(&n1) > applied_before,
        "n1 did not take in the new state:\n{}",
        n1.log_text()
    );
    assert!(
        n1.wait_exit(Duration::from_secs(2)).is_none(),
        "n1 stopped:\n{}",
        n1.log_text()
    );
    assert!(!n1.log_text().contains("removed weft's objects"), "{}", n1.log_text());
    assert_eq!(
        saved(),
        before,
        "the state file changed although it could not be written"
    );
    assert_eq!(
        weftctl_json(&c.target(), &["node", "get", "n1"])["status"]["ready"],
        true
    );

    weft_tests::step("room again: the state is saved and the error goes");
    // Room again: the next report saves it, and the error goes.
    std::fs::remove_dir_all(&obstacle).unwrap();
    eventually("n1 saved its state again", Duration::from_secs(30), || {
        (saved() != before && errors(&c).as_array().is_some_and(|e| e.is_empty())).then_some(())
    });
    assert!(n1.log_text().contains("on disk again"), "{}", n1.log_text());
}

/// A gateway agent refused for anything but its removal keeps what it
/// applied and keeps running, asking again now and then: a thief's doing
/// must not take the site's tunnels down. Here its key and certificate are
/// copied and the copy renews (grpcurl); when the real agent renews next,
/// from its now superseded certificate, every certificate of the name is
/// revoked (two holders). The agent keeps its stored state (a teardown
/// would empty it) and keeps running; the admin sees the conflict.
#[test]
fn a_gateway_refused_but_not_removed_keeps_its_state_and_keeps_running() {
    let Some(grpcurl) = weft_tests::require_tool("grpcurl") else {
        return;
    };
    weft_tests::step("a gateway and a node apply and store their state");
    let dir = tempfile::Builder::new().prefix("weft-refused").tempdir().unwrap();
    let c = ControllerSpec::new("site-a")
        .data_dir(&dir.path().join("ctl"))
        .flags(&["--pod-cidr", "10.1.0.0/16", "--agent-cert-ttl", "12s"])
        .start();
    let mut gw = weft_tests::dry_run_agent("gateway", "gw", "127.0.0.1", &[&c], &c, dir.path());
    let _n1 = weft_tests::dry_run_agent("node", "n1", "127.0.0.2", &[&c], &c, dir.path());
    eventually("the gateway applied its state", Duration::from_secs(20), || {
        gw.log_text().contains("applied revision=").then_some(())
    });
    let state = dir.path().join("gw");
    let stored = || {
        weft_agent::desired::StateFile::new(&state)
            .load()
            .unwrap()
            .map_or(0, |d| d.objects.len())
    };
    // Its whole state: n1's tunnel included (n1 may enroll after the
    // gateway first stored its state).
    let held = eventually("the gateway stored its state", Duration::from_secs(20), || {
        let d = weft_agent::desired::StateFile::new(&state).load().unwrap()?;
        d.objects
            .keys()
            .any(|k| k.starts_with("node/n1/"))
            .then_some(d.objects.len())
    });
    weft_tests::step("a copy of the gateway's identity renews and reports");
    // The copy renews at once (the real agent renews at two thirds of the
    // certificate's 12 s) and uses its new certificate: the real agent's
    // renewal then comes from a certificate older than one in use.
    let (key, csr) = weft_agent::identity::key_and_csr("gw").unwrap();
    let grpcurl_as = |cert: &std::path::Path, key: &std::path::Path, body: String, method: &str| {
        weft_tests::run(
            Command::new(&grpcurl)
                .arg("-cacert")
                .arg(state.join(weft_agent::identity::CA_FILE))
                .arg("-cert")
                .arg(cert)
                .arg("-key")
                .arg(key)
                .args(["-d", &body])
                .arg(format!("127.0.0.1:{}", c.listen_port))
                .arg(format!("weft.v1.AgentService/{method}")),
        )
    };
    let o = grpcurl_as(
        &state.join(weft_agent::identity::CERT_FILE),
        &state.join(weft_agent::identity::KEY_FILE),
        serde_json::json!({ "csr_pem": csr }).to_string(),
        "Renew",
    );
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    let renewed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (copy_cert, copy_key) = (dir.path().join("copy.pem"), dir.path().join("copy.key"));
    std::fs::write(&copy_cert, renewed["certificatePem"].as_str().unwrap()).unwrap();
    std::fs::write(&copy_key, key.serialize_pem()).unwrap();
    let o = grpcurl_as(&copy_cert, &copy_key, "{}".into(), "Report");
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    weft_tests::step("the refused gateway keeps its state and keeps running");
    let log = eventually("the real agent refused", Duration::from_secs(30), || {
        let log = gw.log_text();
        log.contains("keeps forwarding what it has").then_some(log)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        gw.wait_exit(Duration::from_millis(100)).is_none(),
        "the agent stopped:\n{}",
        gw.log_text()
    );
    assert!(!log.contains("removed weft's objects"), "{log}");
    assert_eq!(stored(), held, "the stored state was torn down");
    weft_tests::step("the admin sees the identity conflict");
    let g = weftctl_json(&c.target(), &["gateways"]);
    assert!(
        g["gateways"][0]["identity_conflict"]
            .as_str()
            .unwrap()
            .contains("two hosts hold this identity"),
        "{g}"
    );
}
