//! The faults, on a schedule: a backend killed, stalled or restarted cold, PostgreSQL or Redis
//! cut, a reload with a changed weight.

use super::*;

/// What the fault tasks act on.
pub(super) struct Rig {
    pub(super) start: Instant,
    pub(super) dir: PathBuf,
    pub(super) sims: Mutex<Vec<Proc>>,
    pub(super) sim_ports: Vec<u16>,
    pub(super) pg: Mutex<Option<Cuttable>>,
    pub(super) pg_port: u16,
    pub(super) pg_upstream: std::net::SocketAddr,
    pub(super) redis: Mutex<Option<Cuttable>>,
    pub(super) redis_port: u16,
    pub(super) redis_upstream: std::net::SocketAddr,
    pub(super) a_pid: u32,
    pub(super) a_admin_port: u16,
    pub(super) a_config: PathBuf,
    pub(super) a_plan: GatewayPlan,
    pub(super) shared: Shared,
    pub(super) events: Mutex<Vec<String>>,
    pub(super) reloads_unapplied: Mutex<Vec<String>>,
}

impl Rig {
    pub(super) fn note(&self, what: String) {
        let line = format!("{:7.1} s  {what}", self.start.elapsed().as_secs_f64());
        println!("soak: {line}");
        self.events.lock().unwrap().push(line);
    }

    pub(super) fn sim_signal(&self, i: usize, sig: &str) {
        self.sims.lock().unwrap()[i].signal(sig);
    }

    /// SIGKILL sim `i`, then start it again on the same port (`warmup` seconds refusing
    /// connections, like a cold vLLM instance).
    pub(super) async fn kill_and_restart(&self, i: usize, down: Duration, warmup: u32) {
        self.note(format!("SIGKILL sim{i}"));
        {
            let mut sims = self.sims.lock().unwrap();
            sims[i].signal("KILL");
            let c = sims[i].child.as_mut().unwrap();
            let _ = c.wait();
            sims[i].child = None;
        }
        tokio::time::sleep(down).await;
        let p = spawn_sim(
            i,
            self.sim_ports[i],
            warmup,
            &self.dir.join(format!("sim{i}.log")),
        );
        self.sims.lock().unwrap()[i] = p;
        self.note(if warmup > 0 {
            format!("sim{i} restarted cold: refuses connections for {warmup} s")
        } else {
            format!("sim{i} restarted")
        });
    }

    pub(super) async fn stall(&self, i: usize, for_: Duration) {
        self.note(format!(
            "SIGSTOP sim{i} (stall {:.1} s)",
            for_.as_secs_f64()
        ));
        self.sim_signal(i, "STOP");
        tokio::time::sleep(for_).await;
        self.sim_signal(i, "CONT");
        self.note(format!("SIGCONT sim{i}"));
    }

    pub(super) async fn cut_pg(&self, for_: Duration) {
        let fwd = self.pg.lock().unwrap().take().unwrap();
        fwd.cut();
        self.note(format!("PostgreSQL cut ({:.0} s)", for_.as_secs_f64()));
        tokio::time::sleep(for_).await;
        let fwd = Cuttable::start(self.pg_port, self.pg_upstream).await;
        *self.pg.lock().unwrap() = Some(fwd);
        self.note("PostgreSQL back".into());
    }

    pub(super) async fn cut_redis(&self, for_: Duration) {
        let fwd = self.redis.lock().unwrap().take().unwrap();
        fwd.cut();
        self.note(format!("Redis cut ({:.0} s)", for_.as_secs_f64()));
        tokio::time::sleep(for_).await;
        let fwd = Cuttable::start(self.redis_port, self.redis_upstream).await;
        *self.redis.lock().unwrap() = Some(fwd);
        self.note("Redis back".into());
    }

    /// Rewrite gateway A's config with sim0's weight changed, SIGHUP it, and check that the
    /// reload was applied (its config generation moves on).
    pub(super) async fn reload_a(&self, weight0: u32) {
        let before = config_generation(self.a_admin_port).await;
        std::fs::write(
            &self.a_config,
            gateway_config(&self.a_plan, &self.shared, weight0),
        )
        .unwrap();
        let status = Command::new("kill")
            .args(["-s", "HUP", &self.a_pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success());
        self.note(format!("SIGHUP gateway A (sim0 weight {weight0})"));
        let t = Instant::now();
        while config_generation(self.a_admin_port).await <= before {
            if t.elapsed() > Duration::from_secs(10) {
                self.reloads_unapplied
                    .lock()
                    .unwrap()
                    .push(format!("weight {weight0}"));
                self.note("reload NOT applied within 10 s".into());
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Fault `which` of cycle `cycle`; a cycle runs them in this order, evenly spaced.
pub(super) async fn run_fault(rig: Arc<Rig>, which: usize, cycle: usize) {
    match which {
        0 => rig.kill_and_restart(0, Duration::from_secs(1), 0).await,
        1 => rig.stall(1, Duration::from_secs(2)).await,
        2 => rig.kill_and_restart(2, Duration::from_millis(500), 3).await,
        3 => rig.cut_pg(Duration::from_secs(5)).await,
        4 => rig.cut_redis(Duration::from_secs(5)).await,
        5 => {
            rig.reload_a(if cycle.is_multiple_of(2) { 3 } else { 1 })
                .await
        }
        _ => unreachable!(),
    }
}
pub(super) const FAULTS: usize = 6;

// ----------------------------------------------------------------------------------------------
