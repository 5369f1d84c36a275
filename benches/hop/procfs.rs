//! Readings of processes and of the machine from /proc: CPU time (utime + stime) of the
//! watched processes and of the driver, busy time of the whole machine, and resident memory.

use std::time::Instant;

use crate::error::Res;

/// Linux reports utime/stime in USER_HZ ticks, which is 100 on every architecture we run on.
const TICKS_PER_SEC: f64 = 100.0;

/// utime + stime of a process (all its threads, living and exited), in ticks.
fn cpu_ticks(pid: &str) -> Res<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may contain spaces; the fields after it are plain numbers.
    let close = stat.rfind(')').ok_or("malformed /proc stat")?;
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    // Fields 14 and 15 of stat(5); fields[0] is field 3 (state).
    let utime: u64 = fields.get(11).ok_or("short /proc stat")?.parse()?;
    let stime: u64 = fields.get(12).ok_or("short /proc stat")?.parse()?;
    Ok(utime + stime)
}

/// Total CPU seconds of a set of processes (0 for an empty set).
pub fn cpu_secs(pids: &[u32]) -> Res<f64> {
    let mut ticks = 0;
    for pid in pids {
        ticks += cpu_ticks(&pid.to_string())?;
    }
    Ok(ticks as f64 / TICKS_PER_SEC)
}

pub fn self_cpu_secs() -> Res<f64> {
    Ok(cpu_ticks("self")? as f64 / TICKS_PER_SEC)
}

/// VmRSS and VmHWM of a set of processes, summed, in KiB.
pub fn rss_kib(pids: &[u32]) -> Res<(u64, u64)> {
    let [rss, hwm] = status_kib(pids, ["VmRSS:", "VmHWM:"])?;
    Ok((rss, hwm))
}

/// VmRSS and RssAnon of a set of processes, summed, in KiB: the resident set, and its part
/// without the binary's and libraries' file pages (which a process that has run more of its
/// code has more of).
pub fn rss_anon_kib(pids: &[u32]) -> Res<(u64, u64)> {
    let [rss, anon] = status_kib(pids, ["VmRSS:", "RssAnon:"])?;
    Ok((rss, anon))
}

/// The `/proc/<pid>/status` fields `names` (in kB), each summed over `pids`.
fn status_kib<const N: usize>(pids: &[u32], names: [&str; N]) -> Res<[u64; N]> {
    let mut sums = [0; N];
    for pid in pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        for line in status.lines() {
            for (name, sum) in names.iter().zip(sums.iter_mut()) {
                let value = line
                    .strip_prefix(name)
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
                if let Some(v) = value {
                    *sum += v;
                }
            }
        }
    }
    Ok(sums)
}

/// Busy time of the whole machine (all CPUs, everything but idle and iowait), in seconds.
fn machine_busy_secs() -> Res<f64> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().ok_or("empty /proc/stat")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user)
    let busy = v
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, x)| x);
    Ok(busy.sum::<u64>() as f64 / TICKS_PER_SEC)
}

pub fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The processes whose CPU is reported, read together before and after a measured stretch.
pub struct Watched {
    pub groups: Vec<(&'static str, Vec<u32>)>,
}

#[derive(Clone)]
pub struct CpuReading {
    /// Per group, then the driver itself.
    secs: Vec<f64>,
    machine: f64,
    at: Instant,
}

/// CPU spent between two readings.
pub struct CpuDelta {
    /// Per process group, the driver last.
    pub per: Vec<(&'static str, f64)>,
    /// Busy time of the machine outside the watched processes and the driver (other programs,
    /// and kernel softirq work not charged to any of them), as a share of all CPUs' time.
    pub other_share: f64,
}

impl Watched {
    pub fn read(&self) -> Res<CpuReading> {
        let mut secs = Vec::with_capacity(self.groups.len() + 1);
        for (_, pids) in &self.groups {
            secs.push(cpu_secs(pids)?);
        }
        secs.push(self_cpu_secs()?);
        Ok(CpuReading {
            secs,
            machine: machine_busy_secs()?,
            at: Instant::now(),
        })
    }

    fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.groups
            .iter()
            .map(|(n, _)| *n)
            .chain(std::iter::once("driver"))
    }

    pub fn delta(&self, a: &CpuReading, b: &CpuReading) -> CpuDelta {
        let per: Vec<(&'static str, f64)> = self
            .names()
            .zip(a.secs.iter().zip(&b.secs))
            .map(|(n, (x, y))| (n, y - x))
            .collect();
        let watched: f64 = per.iter().map(|(_, s)| s).sum();
        let wall = b.at.duration_since(a.at).as_secs_f64() * nproc() as f64;
        let other = (b.machine - a.machine - watched).max(0.0);
        CpuDelta {
            per,
            other_share: if wall > 0.0 { other / wall } else { f64::NAN },
        }
    }
}

/// The kernel's TCP counters that tell a connection storm's losses (TcpExt in
/// /proc/net/netstat, for the whole machine): accept-queue overflows (the SYN or the handshake's
/// last ACK dropped because a listener's backlog was full) and SYN retransmissions (a client
/// that waited its 1 s retransmission timeout for that).
#[derive(Clone, Copy, Default)]
pub struct TcpStorm {
    pub listen_drops: u64,
    pub syn_retrans: u64,
}

impl TcpStorm {
    pub fn read() -> Res<TcpStorm> {
        let text = std::fs::read_to_string("/proc/net/netstat")?;
        let mut lines = text.lines();
        let mut out = TcpStorm::default();
        // The file is pairs of lines: "TcpExt: Name Name ..." then "TcpExt: 1 2 ...".
        while let (Some(names), Some(values)) = (lines.next(), lines.next()) {
            if !names.starts_with("TcpExt:") {
                continue;
            }
            for (n, v) in names.split_whitespace().zip(values.split_whitespace()) {
                match n {
                    "ListenDrops" => out.listen_drops = v.parse()?,
                    "TCPSynRetrans" => out.syn_retrans = v.parse()?,
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    pub fn since(self, before: TcpStorm) -> TcpStorm {
        TcpStorm {
            listen_drops: self.listen_drops.saturating_sub(before.listen_drops),
            syn_retrans: self.syn_retrans.saturating_sub(before.syn_retrans),
        }
    }
}
