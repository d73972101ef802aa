//! The userspace WireGuard device's per-packet peer lookup: its route
//! table against a scan of every allowed network, at 1, 33 and 2,112
//! networks (docs/benchmarks.md). Run it from a release build:
//! `cargo run --release -p weft-wg-device --example route_bench`.

fn main() {
    // A warm-up pass, then the measured one.
    let _ = weft_wg_device::route_bench::run(2);
    for (networks, table, scan) in weft_wg_device::route_bench::run(50) {
        println!(
            "{networks:>5} networks: route table {table:>7.1} ns, scan of every network {scan:>9.1} ns per lookup ({:.1}x)",
            scan / table
        );
    }
}
