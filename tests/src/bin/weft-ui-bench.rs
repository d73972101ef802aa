//! How fast `weftctl ui` first renders a large site: a hub controller
//! peered with `--peers` real controllers (every tenth with pods that
//! overlap the hub's, so its view is remapped) and, in the same run, a
//! small hub peered with two, each read by its own `weftctl ui` and
//! loaded in headless Chromium (see `weft_tests::browser`). Every page
//! load is timed by the browser itself (Navigation and Paint Timing): to
//! the first contentful paint, and to the load event. The controllers and
//! the browsers run in lab namespaces on their own loopback. Needs root.
//!
//! `weft-ui-bench --peers 50 --loads 10` (see docs/benchmarks.md).

use std::time::Duration;

use clap::Parser;
use fantoccini::{Client, Locator};
use weft_tests::browser::{self, within};
use weft_tests::netns::Lab;
use weft_tests::{ControllerSpec, sites};

#[derive(Parser, Debug)]
struct Args {
    /// Peerings of the large hub.
    #[arg(long, default_value_t = 50)]
    peers: usize,
    /// Page loads timed on each hub (the first through the link's token).
    #[arg(long, default_value_t = 10)]
    loads: usize,
}

/// A hub site with `n` peers on lab host `ns`: its weftctl target.
fn hub(lab: &mut Lab, ns: &str, dir: &std::path::Path, name: &str, n: usize) -> String {
    let hub = lab.controller(
        ns,
        ControllerSpec::new(name).data_dir(&dir.join(name)).pod("10.0.0.0/16"),
    );
    for i in 1..=n {
        let site = format!("{name}-p{i:02}");
        // Every tenth overlaps the hub: its view is remapped.
        let pod = if i % 10 == 0 {
            "10.0.0.0/16".to_string()
        } else {
            format!("10.{i}.0.0/16")
        };
        let peer = lab.controller(ns, ControllerSpec::new(&site).data_dir(&dir.join(&site)).pod(&pod));
        sites::peer_with(&peer, &hub);
    }
    hub
}

/// Times: (first contentful paint, load event), in ms from navigation start.
async fn timing(b: &Client) -> (f64, f64) {
    let t = b
        .execute(
            "const n = performance.getEntriesByType('navigation')[0];
             const p = performance.getEntriesByName('first-contentful-paint')[0];
             return [p ? p.startTime : -1, n ? n.loadEventEnd : -1];",
            vec![],
        )
        .await
        .unwrap();
    (t[0].as_f64().unwrap(), t[1].as_f64().unwrap())
}

/// Loads the page `loads` times (the link first, then reloads): each
/// load's timing, once all `rows` peerings are on the page.
async fn measure(b: Client, url: String, rows: usize, loads: usize) -> (Vec<(f64, f64)>, usize) {
    let mut times = Vec::new();
    for i in 0..loads {
        if i == 0 {
            b.goto(&url).await.unwrap();
        } else {
            b.refresh().await.unwrap();
        }
        within("every peering on the page", Duration::from_secs(30), || async {
            b.find_all(Locator::Css("tr[data-peer]"))
                .await
                .map(|r| r.len())
                .unwrap_or(0)
                == rows
        })
        .await;
        // Both are stamped once they happened (the paint may come after
        // the load event).
        let mut t = timing(&b).await;
        for _ in 0..500 {
            if t.0 > 0.0 && t.1 > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            t = timing(&b).await;
        }
        assert!(t.0 > 0.0 && t.1 > 0.0, "no paint or load timing after 10 s: {t:?}");
        times.push(t);
    }
    let size = b.source().await.unwrap().len();
    b.close().await.unwrap();
    (times, size)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args = Args::parse();
    assert!(
        args.peers >= 2 && args.loads >= 1,
        "--peers 2 or more, --loads 1 or more"
    );
    let dir = tempfile::Builder::new().prefix("weft-ui-bench").tempdir().unwrap();
    let mut lab = Lab::new("uibench");
    let ns = lab.host("sites");
    let t = std::time::Instant::now();
    let large = hub(&mut lab, &ns, dir.path(), "hub", args.peers);
    let small = hub(&mut lab, &ns, dir.path(), "small", 2);
    eprintln!(
        "weft-ui-bench: {} controllers up and peered in {:.0} s",
        args.peers + 5,
        t.elapsed().as_secs_f64()
    );
    let mut results = Vec::new();
    for (name, target, rows) in [("large", &large, args.peers), ("small", &small, 2)] {
        let host = browser::Host::start(&mut lab, &format!("ui-{name}"), target, dir.path());
        let (url, loads) = (host.url.clone(), args.loads);
        results.push(host.drive(move |b| measure(b, url, rows, loads)));
    }
    let summary = |(times, size): &(Vec<(f64, f64)>, usize)| {
        let fcp = median(times.iter().map(|t| t.0).collect());
        let load = median(times.iter().map(|t| t.1).collect());
        let worst = times.iter().map(|t| t.0).fold(0.0, f64::max);
        (fcp, load, worst, *size)
    };
    let (l, s) = (summary(&results[0]), summary(&results[1]));
    println!(
        "weft-ui-bench: {} peerings: first contentful paint median {:.0} ms, load event median {:.0} ms, worst \
         paint {:.0} ms (the first load, through the token, included), page {} KiB; 2 peerings: {:.0} ms, {:.0} ms, \
         worst {:.0} ms, {} KiB; large/small paint ratio {:.2}; {} loads each",
        args.peers,
        l.0,
        l.1,
        l.2,
        l.3 / 1024,
        s.0,
        s.1,
        s.2,
        s.3 / 1024,
        l.0 / s.0,
        args.loads
    );
}
