//! `weftctl ui` in a real browser: three sites (a with two gateways,
//! peered with b, whose pods overlap a's, and with c), `weftctl ui` on site
//! a's admin socket, and headless Chromium through chromedriver, all on a
//! host with only a loopback ([`weft_tests::browser`]).
//!
//! Checked: the page is refused without the printed token, the token
//! works once, and another name for 127.0.0.1 is refused; every peering
//! shows with weftctl's state and path; a peering's details open by
//! keyboard; screenshots at 1280×800 and at a phone's width are saved,
//! and the phone's has no sideways scrolling; a killed active gateway
//! shows as the standby turned active, and a deleted peering disappears,
//! each within 5 s; and the controller listens on exactly the sockets it
//! did before.

use std::time::{Duration, Instant};

use fantoccini::{Client, Locator};
use weft_tests::browser::{self, UI_PORT, attr, get, listening, screenshot, text, within};
use weft_tests::sites::{self, active, relay_site};
use weft_tests::{bin, eventually, step, weftctl_json};

/// What the page must show and do, and where to keep its screenshots.
struct Plan {
    target: String,
    url: String,
    /// (site, state, path) of every peering, as weftctl says.
    want: Vec<(String, String, String)>,
    victim_pid: u32,
    survivor: &'static str,
    shots: std::path::PathBuf,
}

#[test]
#[ignore = "needs root, Chromium and chromedriver (tests/run.sh)"]
fn the_page_shows_the_fabric_live_in_a_real_browser() {
    browser::tools();
    step("three sites: a (two gateways) peered with b and with c");
    let mut s = sites::up_with(
        "ui",
        ("a", "10.1.0.0/16"),
        ("b", "10.1.0.0/16"),
        sites::Opts {
            second_gateway_a: true,
            ..Default::default()
        },
    );
    let _c = relay_site(&mut s, "c", 1, "10.63.0.0/16", (true, false));
    let ta = s.ta.clone();
    let peerings = eventually("both of a's peerings connected", Duration::from_secs(60), || {
        let p = weftctl_json(&ta, &["peerings"]);
        let all = p["peerings"].as_array().unwrap().clone();
        let up = |p: &serde_json::Value| p["state"] == "connected" && p["tunnel"]["up"] == true;
        (all.len() == 2 && all.iter().all(up)).then_some(all)
    });
    let first_active = eventually("an active gateway", Duration::from_secs(20), || {
        Some(active(&ta)).filter(|a| !a.is_empty())
    });
    let ctl = (0..3).find(|i| s.lab.ctl(*i).target() == ta).unwrap();
    let ctl_pid = s.lab.ctl(ctl).pid();
    let before = listening(ctl_pid);
    assert!(!before.is_empty(), "the controller listens somewhere");

    step("weftctl ui and chromedriver on a host with only a loopback");
    let host = browser::Host::start(&mut s.lab, "ui", &ta, s.dir.path());
    assert!(
        host.url.starts_with(&format!("http://127.0.0.1:{UI_PORT}/?token=")),
        "{}",
        host.url
    );
    let shots = bin("weftctl").parent().unwrap().join("ui-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let victim = if first_active == "gw" {
        s.gateways.0
    } else {
        s.gateway_a2.unwrap()
    };
    let plan = Plan {
        target: ta,
        url: host.url.clone(),
        want: peerings
            .iter()
            .map(|p| {
                let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
                (text(&p["site_id"]), text(&p["state"]), text(&p["tunnel"]["path"]))
            })
            .collect(),
        victim_pid: s.lab.proc(victim).child.as_ref().unwrap().id(),
        survivor: if first_active == "gw" { "gw2" } else { "gw" },
        shots,
    };
    let report = host.drive(move |b| drive(b, plan));
    println!("{report}");

    step("the controller listens where it did");
    assert_eq!(listening(ctl_pid), before, "the controller's listening sockets changed");
}

/// Everything the browser does; a line of what it saw.
async fn drive(b: Client, p: Plan) -> String {
    let base = format!("http://127.0.0.1:{UI_PORT}/");
    let own = format!("127.0.0.1:{UI_PORT}");
    step("refused without the token");
    let (code, body) = get("/", &own);
    assert_eq!(code, 403, "no token, no page: {body}");
    let csp = "content-security-policy: default-src 'none'; script-src 'self';";
    assert!(
        body.to_ascii_lowercase().contains(csp),
        "no inline script may run: {body}"
    );
    assert_eq!(get("/live", &own).0, 403, "no token, no updates");
    let rebound = format!("weft.example:{UI_PORT}");
    assert_eq!(
        get("/", &rebound).0,
        421,
        "another name for 127.0.0.1 (a rebound DNS name) is refused"
    );
    assert_eq!(get("/live", &rebound).0, 421);
    b.goto(&base).await.unwrap();
    let refused = text(&b, "#refused").await.unwrap_or_default();
    assert!(refused.contains("needs the link"), "{refused}");

    step("the page with the token");
    let t = Instant::now();
    b.goto(&p.url).await.unwrap();
    b.wait()
        .for_element(Locator::Css("#live table.peerings"))
        .await
        .unwrap();
    let loaded = t.elapsed();
    assert_eq!(
        b.current_url().await.unwrap().as_str(),
        base,
        "the token is gone from the address bar"
    );
    let token_path = p.url.trim_start_matches(&format!("http://{own}"));
    assert_eq!(get(token_path, &own).0, 403, "the token works once");
    let cookie = b.get_all_cookies().await.unwrap();
    assert_eq!(cookie.len(), 1, "one session cookie: {cookie:?}");
    assert_eq!(cookie[0].http_only(), Some(true), "out of the page's scripts' reach");
    let same_site = format!("{:?}", cookie[0].same_site());
    assert_eq!(same_site, "Some(Strict)", "sent by no other site's page");

    step("every peering with its path and state");
    within(
        "every peering with weftctl's state and path",
        Duration::from_secs(5),
        || async {
            for (site, state, path) in &p.want {
                let css = format!("tr[data-peer=\"{site}\"]");
                if attr(&b, &css, "data-state").await.as_deref() != Some(state.as_str()) {
                    return false;
                }
                let shown = attr(&b, &css, "data-path").await.unwrap_or_default();
                if path.is_empty() || !shown.starts_with(path.as_str()) {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let rows = b.find_all(Locator::Css("tr[data-peer]")).await.unwrap().len();
    assert_eq!(rows, p.want.len(), "one row per peering");
    let clock = text(&b, "#clock").await.unwrap_or_default();
    assert!(clock.starts_with("updated"), "live: {clock}");

    step("screenshots");
    within("diagnose's first report", Duration::from_secs(20), || async {
        text(&b, "#diagnose").await.is_some_and(|t| t.contains("checked at"))
    })
    .await;
    let wide = screenshot(&b, &p.shots, "ui-1280x800.png", (1280, 800)).await;
    let phone = screenshot(&b, &p.shots, "ui-phone-390x844.png", (390, 844)).await;
    println!("screenshots: {} {}", wide.display(), phone.display());
    let overflow = b
        .execute(
            "return document.documentElement.scrollWidth - window.innerWidth",
            vec![],
        )
        .await
        .unwrap();
    assert!(
        overflow.as_i64().unwrap_or(1) <= 0,
        "sideways scrolling at a phone's width: {overflow}"
    );
    browser::viewport(&b, (1280, 800)).await;

    step("a peering's details, by keyboard");
    let first = "b";
    let link = b.find(Locator::Css(&format!("#row-{first}"))).await.unwrap();
    link.send_keys("\u{E007}").await.unwrap(); // Enter: the link followed by keyboard
    within(
        "the details of the chosen peering open",
        Duration::from_secs(2),
        || async { attr(&b, &format!("details#peering-{first}"), "open").await.is_some() },
    )
    .await;
    let detail = text(&b, &format!("details#peering-{first}")).await.unwrap_or_default();
    assert!(
        detail.contains("remapped") && detail.contains("may reach here") && detail.contains("exports here"),
        "the views (b's pods overlap a's), the export policy and what b exports: {detail}"
    );

    // The reader moves on to the details' summary (as Tab would).
    let focus = format!("document.getElementById('sum-{first}').focus(); return document.activeElement.id");
    let focused = b.execute(&focus, vec![]).await.unwrap();
    assert_eq!(focused.as_str(), Some(format!("sum-{first}").as_str()));

    step("the active gateway is killed");
    let survivor = format!("tr[data-gateway=\"{}\"]", p.survivor);
    let role = attr(&b, &survivor, "data-role").await;
    assert_eq!(
        role.as_deref(),
        Some("standby"),
        "before the kill, {} stands by",
        p.survivor
    );
    let st = std::process::Command::new("kill")
        .args(["-KILL", &p.victim_pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let failover = within("the standby as active", Duration::from_secs(5), || async {
        attr(&b, &survivor, "data-role").await.as_deref() == Some("active")
    })
    .await;
    assert!(
        attr(&b, &format!("details#peering-{first}"), "open").await.is_some(),
        "the details the reader opened stay open across updates"
    );
    let focused = b.execute("return document.activeElement.id", vec![]).await.unwrap();
    assert_eq!(
        focused.as_str(),
        Some(format!("sum-{first}").as_str()),
        "the reader's focus stays across updates"
    );

    step("a peering is deleted");
    let gone = "c";
    let o = weft_tests::run(std::process::Command::new(bin("weftctl")).args([
        "--controller",
        &p.target,
        "peering",
        "delete",
        gone,
    ]));
    assert!(o.status.success(), "{}", weft_tests::stderr(&o));
    let removed = within("the deleted peering gone", Duration::from_secs(5), || async {
        text(&b, &format!("tr[data-peer=\"{gone}\"]")).await.is_none()
    })
    .await;
    let events = text(&b, "ol.events").await.unwrap_or_default();
    assert!(
        events.contains(&format!("gateway {} is active now", p.survivor)),
        "{events}"
    );
    assert!(events.contains(&format!("peering with {gone} is gone")), "{events}");
    b.close().await.unwrap();
    format!(
        "page loaded in {:.0} ms; the standby shown active {:.1} s after the kill; the deleted peering gone {:.1} s \
         after weftctl returned",
        loaded.as_secs_f64() * 1000.0,
        failover.as_secs_f64(),
        removed.as_secs_f64()
    )
}
