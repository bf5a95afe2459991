//! Launching one process per rank, the way torchrun and Slurm do it, and the TCP rendezvous
//! that hands rank 0's NCCL unique id to everyone.
//!
//! Environment (torchrun's names, `torch.distributed.run`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`; under `srun` without torchrun, `SLURM_PROCID`, `SLURM_NTASKS`
//! and `SLURM_LOCALID` stand in for the first three (`MASTER_ADDR`/`MASTER_PORT` must still be
//! exported, as for torch's `env://` init). Neither set means a single process drives every
//! rank.
//!
//! The rendezvous plays the part of torch's TCPStore for one value: rank 0 listens on
//! `MASTER_PORT` (`MASTER_PORT + 1` under torchrun, whose agent already listens on
//! `MASTER_PORT`: [`AGENT_STORE_ENV`]), every other rank connects to it (retrying until rank 0
//! is up or the deadline passes), says who it is, and once all `WORLD_SIZE - 1` peers have
//! checked in rank 0 sends each of them the payload (the 128-byte `ncclUniqueId` of each NCCL
//! communicator, [`encode_ids`]). It is generic over the payload bytes and needs no GPU, so it
//! is tested on loopback.

use std::collections::BTreeSet;
use std::fmt;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// One rank's place in a multi-process launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: u32,
    pub world_size: u32,
    /// The GPU this process uses (`LOCAL_RANK`, else `SLURM_LOCALID`, else 0).
    pub local_rank: u32,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// The port of pipec's rendezvous: `MASTER_PORT`, or `MASTER_PORT + 1` under torchrun's
    /// agent store ([`AGENT_STORE_ENV`]), where torchrun itself listens on `MASTER_PORT`.
    pub master_port: u16,
    /// Which convention supplied the rank: "RANK" or "SLURM_PROCID".
    pub from: &'static str,
}

impl LaunchEnv {
    /// `MASTER_ADDR:MASTER_PORT`.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// Set by torchrun in every worker's environment (`LocalElasticAgent._start_workers`,
/// `torch.distributed.elastic`). `True` means the agent of group rank 0 keeps a TCPStore server
/// listening on `MASTER_PORT` for the whole job (static rendezvous: `StaticTCPRendezvous`,
/// "listener on the agent with group_rank=0"; the workers connect to it as clients), so rank
/// 0 of pipec-run cannot listen there: its rendezvous moves to the next port.
pub const AGENT_STORE_ENV: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// A launch variable is missing or malformed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchError(pub String);

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LaunchError {}

fn num(get: &dyn Fn(&str) -> Option<String>, key: &str) -> Result<Option<u32>, LaunchError> {
    match get(key) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<u32>()
            .map(Some)
            .map_err(|_| LaunchError(format!("{key}=`{v}` is not a non-negative integer"))),
    }
}

/// Parse the launch variables through `get` (`std::env::var(..).ok()` in the binary, a map in
/// tests). `Ok(None)`: no rank variable is set, run every rank in this process.
pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, LaunchError> {
    let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
    let (rank, world_key, local_key, from) = if get("RANK").is_some() {
        (num(&get, "RANK")?, "WORLD_SIZE", "LOCAL_RANK", "RANK")
    } else if get("SLURM_PROCID").is_some() {
        (
            num(&get, "SLURM_PROCID")?,
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_PROCID",
        )
    } else {
        return Ok(None);
    };
    let rank = rank.expect("checked present");
    let world = num(&get, world_key)?.ok_or_else(|| {
        LaunchError(format!(
            "{from}={rank} is set but {world_key} is not: a multi-process launch needs both"
        ))
    })?;
    if world == 0 {
        return Err(LaunchError(format!(
            "{world_key}=0: there must be at least one rank"
        )));
    }
    if rank >= world {
        return Err(LaunchError(format!(
            "{from}={rank} is out of range for {world_key}={world} (ranks are 0..{world})"
        )));
    }
    let local_rank = num(&get, local_key)?
        .or(if from == "RANK" {
            num(&get, "SLURM_LOCALID")?
        } else {
            None
        })
        .unwrap_or(0);
    let master_addr = get("MASTER_ADDR").map(|s| s.trim().to_string());
    let master_port = get("MASTER_PORT");
    let (master_addr, master_port) = match (master_addr, master_port) {
        (Some(a), Some(p)) => {
            let port = p
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| {
                    LaunchError(format!("MASTER_PORT=`{p}` is not a TCP port (1..65535)"))
                })?;
            let agent_store =
                get(AGENT_STORE_ENV).is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
            if !agent_store {
                (a, port)
            } else {
                let next = port.checked_add(1).ok_or_else(|| {
                    LaunchError(format!(
                        "MASTER_PORT={port} is torchrun's own store ({AGENT_STORE_ENV}=True) and pipec's rendezvous uses the next port, but there is none; pick a lower MASTER_PORT"
                    ))
                })?;
                (a, next)
            }
        }
        // One rank needs no rendezvous.
        _ if world == 1 => ("127.0.0.1".to_string(), 29500),
        (a, p) => {
            let missing: Vec<&str> = [("MASTER_ADDR", a.is_none()), ("MASTER_PORT", p.is_none())]
                .iter()
                .filter(|(_, m)| *m)
                .map(|(k, _)| *k)
                .collect();
            return Err(LaunchError(format!(
                "{from}={rank}, {world_key}={world} but {} not set: rank 0 shares the NCCL id at MASTER_ADDR:MASTER_PORT",
                missing.join(" and ")
            )));
        }
    };
    Ok(Some(LaunchEnv {
        rank,
        world_size: world,
        local_rank,
        master_addr,
        master_port,
        from,
    }))
}

/// The rendezvous failed; the message names the ranks and the address involved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousError(pub String);

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RendezvousError {}

const MAGIC: &[u8; 8] = b"PIPECRV1";
/// Largest payload accepted (an `ncclUniqueId` is 128 bytes; a launch sends one per
/// communicator, [`encode_ids`]).
pub const MAX_PAYLOAD: usize = 1 << 20;

fn rv(msg: impl Into<String>) -> RendezvousError {
    RendezvousError(msg.into())
}

/// Rank 0's side: a bound listener.
pub struct Server {
    listener: TcpListener,
}

impl Server {
    /// Listen on `addr` (`0.0.0.0:MASTER_PORT` in a launch, `127.0.0.1:0` in tests).
    pub fn bind(addr: &str) -> Result<Server, RendezvousError> {
        let listener = TcpListener::bind(addr).map_err(|e| {
            rv(format!(
                "rank 0 cannot listen on {addr}: {e} (is MASTER_PORT in use by another job?)"
            ))
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|e| rv(format!("rank 0: {e}")))?;
        Ok(Server { listener })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Wait until ranks `1..world` have all checked in, then send each `payload`. Fails (and
    /// tells the ranks that did connect) when the deadline passes first, naming the missing
    /// ranks, or when a peer announces a different world size or a duplicate rank.
    pub fn serve(
        self,
        world: u32,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), RendezvousError> {
        if payload.len() > MAX_PAYLOAD {
            return Err(rv(format!(
                "rendezvous payload of {} bytes is too large",
                payload.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        let mut peers: Vec<(u32, TcpStream)> = Vec::new();
        let mut seen = BTreeSet::new();
        let result = loop {
            if seen.len() as u32 + 1 >= world {
                break Ok(());
            }
            match self.listener.accept() {
                Ok((mut s, from)) => {
                    let _ = s.set_nonblocking(false);
                    let left = deadline.saturating_duration_since(Instant::now());
                    let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(100))));
                    let _ = s.set_write_timeout(Some(Duration::from_secs(5)));
                    match read_hello(&mut s) {
                        Ok((r, w)) if w != world => {
                            let msg = format!(
                                "rank {r} (from {from}) has WORLD_SIZE={w}, rank 0 has {world}"
                            );
                            let _ = reply(&mut s, Err(&msg));
                            break Err(rv(msg));
                        }
                        Ok((r, _)) if r == 0 || r >= world => {
                            let msg =
                                format!("a peer at {from} claims rank {r}, outside 1..{world}");
                            let _ = reply(&mut s, Err(&msg));
                            break Err(rv(msg));
                        }
                        Ok((r, _)) if !seen.insert(r) => {
                            let msg = format!("rank {r} checked in twice (second from {from})");
                            let _ = reply(&mut s, Err(&msg));
                            break Err(rv(msg));
                        }
                        Ok((r, _)) => peers.push((r, s)),
                        // A stray connection (port scanner, health check): ignore it.
                        Err(_) => {}
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (1..world)
                            .filter(|r| !seen.contains(r))
                            .map(|r| r.to_string())
                            .collect();
                        break Err(rv(format!(
                            "rank 0 waited {:.1} s on {} and ranks {} never checked in",
                            timeout.as_secs_f64(),
                            self.local_addr(),
                            missing.join(", ")
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => break Err(rv(format!("rank 0: accept failed: {e}"))),
            }
        };
        match result {
            Ok(()) => {
                for (r, s) in &mut peers {
                    reply(s, Ok(payload))
                        .map_err(|e| rv(format!("rank 0 could not answer rank {r}: {e}")))?;
                }
                Ok(())
            }
            Err(e) => {
                for (_, s) in &mut peers {
                    let _ = reply(s, Err(&format!("rank 0 gave up: {e}")));
                }
                Err(e)
            }
        }
    }
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(u32, u32)> {
    let mut b = [0u8; 16];
    s.read_exact(&mut b)?;
    if &b[..8] != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a pipec peer",
        ));
    }
    let r = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    let w = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes"));
    Ok((r, w))
}

fn reply(s: &mut TcpStream, what: Result<&[u8], &str>) -> std::io::Result<()> {
    let (status, body): (u8, &[u8]) = match what {
        Ok(p) => (0, p),
        Err(m) => (1, m.as_bytes()),
    };
    let mut msg = Vec::with_capacity(5 + body.len());
    msg.push(status);
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    s.write_all(&msg)?;
    s.flush()
}

/// A non-zero rank's side: connect to rank 0 at `master` (retrying while it is not up yet),
/// check in as `rank` of `world`, and wait for the payload, all within `timeout`.
pub fn fetch(
    master: &str,
    rank: u32,
    world: u32,
    timeout: Duration,
) -> Result<Vec<u8>, RendezvousError> {
    let deadline = Instant::now() + timeout;
    let addrs: Vec<SocketAddr> = master
        .to_socket_addrs()
        .map_err(|e| {
            rv(format!(
                "rank {rank}: cannot resolve MASTER_ADDR:MASTER_PORT `{master}`: {e}"
            ))
        })?
        .collect();
    let mut last_err = String::from("no address");
    let mut stream = None;
    while stream.is_none() {
        for a in &addrs {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(
                a,
                left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
            ) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last_err = e.to_string(),
            }
        }
        if stream.is_none() {
            if Instant::now() >= deadline {
                return Err(rv(format!(
                    "rank {rank}: rank 0 is not reachable at {master} after {:.1} s ({last_err}); is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let mut s = stream.expect("connected");
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    let _ = s.set_read_timeout(Some(left));
    let _ = s.set_write_timeout(Some(left));
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&world.to_le_bytes());
    let io = |e: std::io::Error| {
        let waited = matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        );
        rv(if waited {
            format!(
                "rank {rank}: connected to rank 0 at {master} but got no answer within {:.1} s (other ranks have not checked in?)",
                timeout.as_secs_f64()
            )
        } else {
            format!("rank {rank}: rendezvous with rank 0 at {master} failed: {e}")
        })
    };
    s.write_all(&hello).map_err(io)?;
    let mut head = [0u8; 5];
    s.read_exact(&mut head).map_err(io)?;
    let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD {
        return Err(rv(format!(
            "rank {rank}: rank 0 announced a {len}-byte answer"
        )));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(io)?;
    match head[0] {
        0 => Ok(body),
        _ => Err(rv(format!(
            "rank {rank}: refused by rank 0: {}",
            String::from_utf8_lossy(&body)
        ))),
    }
}

/// Bytes of one `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES` in `nccl.h`).
pub const NCCL_ID_BYTES: usize = 128;

/// The payload of a launch's rendezvous: the NCCL unique ids of all the communicators, back to
/// back, in the order every rank creates them (the one over all ranks, then the P2P groups in
/// [`crate::groups::GroupPlan`]'s order). The receiving rank knows how many to expect from the
/// same program ([`decode_ids`]), so no count travels.
pub fn encode_ids(ids: &[[u8; NCCL_ID_BYTES]]) -> Result<Vec<u8>, RendezvousError> {
    let len = ids.len() * NCCL_ID_BYTES;
    if len > MAX_PAYLOAD {
        return Err(rv(format!(
            "{} NCCL communicators need {len} bytes of unique ids, more than the rendezvous \
             carries ({MAX_PAYLOAD} bytes)",
            ids.len()
        )));
    }
    Ok(ids.concat())
}

/// The `count` NCCL unique ids of an [`encode_ids`] payload; a payload of another length (rank
/// 0 read a different program, so planned another number of communicators) is an error.
pub fn decode_ids(bytes: &[u8], count: usize) -> Result<Vec<[u8; NCCL_ID_BYTES]>, RendezvousError> {
    if bytes.len() != count * NCCL_ID_BYTES {
        return Err(rv(format!(
            "rank 0 sent {} bytes of NCCL unique ids where this rank expects {count} \
             communicators of {NCCL_ID_BYTES} bytes each ({} bytes): do all ranks run the same \
             program?",
            bytes.len(),
            count * NCCL_ID_BYTES
        )));
    }
    Ok(bytes
        .chunks_exact(NCCL_ID_BYTES)
        .map(|c| c.try_into().expect("chunks of NCCL_ID_BYTES"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_variables_parse() {
        let e = from_vars(vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                master_addr: "node0".into(),
                master_port: 29500,
                from: "RANK"
            }
        );
        assert_eq!(e.master(), "node0:29500");
        let v6 = LaunchEnv {
            master_addr: "::1".into(),
            ..e
        };
        assert_eq!(v6.master(), "[::1]:29500");
    }

    /// Under torchrun's agent store, `MASTER_PORT` is torchrun's TCPStore: pipec's rendezvous
    /// takes the next port; without it (srun, or `False`) `MASTER_PORT` itself.
    #[test]
    fn torchrun_agent_store_moves_the_rendezvous_to_the_next_port() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ];
        let with = |v: &'static str| {
            let mut kv = base.to_vec();
            kv.push((AGENT_STORE_ENV, v));
            from_vars(vars(&kv))
        };
        assert_eq!(with("True").unwrap().unwrap().master_port, 29501);
        assert_eq!(with("True").unwrap().unwrap().master(), "node0:29501");
        assert_eq!(with("False").unwrap().unwrap().master_port, 29500);
        assert_eq!(from_vars(vars(&base)).unwrap().unwrap().master_port, 29500);
        let mut top = base.to_vec();
        top[3] = ("MASTER_PORT", "65535");
        top.push((AGENT_STORE_ENV, "True"));
        let e = from_vars(vars(&top)).unwrap_err().to_string();
        assert!(
            e.contains("MASTER_PORT=65535") && e.contains("torchrun"),
            "{e}"
        );
    }

    #[test]
    fn slurm_variables_parse_and_no_variables_mean_single_process() {
        let e = from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.from),
            (5, 6, 2, "SLURM_PROCID")
        );
        assert_eq!(from_vars(vars(&[])).unwrap(), None);
        // WORLD_SIZE alone (as `pipec-run` reads it for --world-size) is not a launch.
        assert_eq!(from_vars(vars(&[("WORLD_SIZE", "4")])).unwrap(), None);
        // One rank needs no master.
        let one = from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!(one.world_size, 1);
    }

    #[test]
    fn malformed_or_missing_variables_are_clear_errors() {
        let err = |kv: &[(&str, &str)]| from_vars(vars(kv)).unwrap_err().to_string();
        assert_eq!(
            err(&[("RANK", "x")]),
            "RANK=`x` is not a non-negative integer"
        );
        assert_eq!(
            err(&[("RANK", "1")]),
            "RANK=1 is set but WORLD_SIZE is not: a multi-process launch needs both"
        );
        assert_eq!(
            err(&[("RANK", "4"), ("WORLD_SIZE", "4")]),
            "RANK=4 is out of range for WORLD_SIZE=4 (ranks are 0..4)"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "0")]),
            "WORLD_SIZE=0: there must be at least one rank"
        );
        assert_eq!(
            err(&[("RANK", "1"), ("WORLD_SIZE", "2")]),
            "RANK=1, WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT not set: rank 0 shares the NCCL id at MASTER_ADDR:MASTER_PORT"
        );
        assert_eq!(
            err(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]),
            "RANK=1, WORLD_SIZE=2 but MASTER_PORT not set: rank 0 shares the NCCL id at MASTER_ADDR:MASTER_PORT"
        );
        assert_eq!(
            err(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "70000")
            ]),
            "MASTER_PORT=`70000` is not a TCP port (1..65535)"
        );
        assert_eq!(
            err(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "-1"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "1")
            ]),
            "LOCAL_RANK=`-1` is not a non-negative integer"
        );
    }

    /// Every rank of a 5-rank world gets rank 0's payload, whichever order they arrive in and
    /// even when some start before rank 0 listens.
    #[test]
    fn rendezvous_delivers_the_payload_to_every_rank() {
        // Reserve a free port, release it, and let ranks 1-2 start before rank 0 binds it.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let master = format!("127.0.0.1:{port}");
        let payload: Vec<u8> = (0..128u32).map(|i| (i * 7 + 3) as u8).collect();
        let t = Duration::from_secs(20);
        let early: Vec<_> = (1..3)
            .map(|r| {
                let m = master.clone();
                std::thread::spawn(move || fetch(&m, r, 5, t))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        let server = Server::bind(&master).unwrap();
        let p = payload.clone();
        let s = std::thread::spawn(move || server.serve(5, &p, t));
        let late: Vec<_> = (3..5)
            .map(|r| {
                let m = master.clone();
                std::thread::spawn(move || fetch(&m, r, 5, t))
            })
            .collect();
        s.join().unwrap().unwrap();
        for h in early.into_iter().chain(late) {
            assert_eq!(h.join().unwrap().unwrap(), payload);
        }
    }

    #[test]
    fn absent_rank_zero_is_a_clear_error_after_the_timeout() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let master = format!("127.0.0.1:{port}");
        let e = fetch(&master, 2, 4, Duration::from_millis(300))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "rank 2: rank 0 is not reachable at {master} after 0.3 s"
            )),
            "{e}"
        );
        assert!(e.contains("is rank 0 running"), "{e}");
    }

    #[test]
    fn missing_ranks_are_named_and_connected_ranks_are_told() {
        let server = Server::bind("127.0.0.1:0").unwrap();
        let master = server.local_addr().to_string();
        let s = std::thread::spawn(move || server.serve(4, b"id", Duration::from_millis(500)));
        let m = master.clone();
        let one = std::thread::spawn(move || fetch(&m, 1, 4, Duration::from_secs(10)));
        let e = s.join().unwrap().unwrap_err().to_string();
        assert!(e.starts_with("rank 0 waited 0.5 s on "), "{e}");
        assert!(e.ends_with("ranks 2, 3 never checked in"), "{e}");
        let e1 = one.join().unwrap().unwrap_err().to_string();
        assert!(
            e1.starts_with("rank 1: refused by rank 0: rank 0 gave up: rank 0 waited"),
            "{e1}"
        );
    }

    #[test]
    fn mismatched_world_sizes_and_duplicate_ranks_are_refused() {
        let server = Server::bind("127.0.0.1:0").unwrap();
        let master = server.local_addr().to_string();
        let s = std::thread::spawn(move || server.serve(3, b"id", Duration::from_secs(10)));
        let e = fetch(&master, 1, 2, Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("has WORLD_SIZE=2, rank 0 has 3"), "{e}");
        assert!(s
            .join()
            .unwrap()
            .unwrap_err()
            .to_string()
            .contains("has WORLD_SIZE=2"));

        let server = Server::bind("127.0.0.1:0").unwrap();
        let master = server.local_addr().to_string();
        let s = std::thread::spawn(move || server.serve(3, b"id", Duration::from_secs(10)));
        // Two processes both claim rank 1: whichever arrives second is refused as a
        // duplicate, the first is told that rank 0 gave up.
        let m = master.clone();
        let first = std::thread::spawn(move || fetch(&m, 1, 3, Duration::from_secs(10)));
        let second = fetch(&master, 1, 3, Duration::from_secs(10))
            .unwrap_err()
            .to_string();
        let first = first.join().unwrap().unwrap_err().to_string();
        let mut msgs = [first, second];
        // The duplicate's own refusal does not say "gave up"; the first rank's does (and may
        // quote the duplicate as the reason), so order by that.
        msgs.sort_by_key(|m| m.contains("gave up"));
        assert!(msgs[0].contains("rank 1 checked in twice"), "{msgs:?}");
        assert!(!msgs[0].contains("gave up"), "{msgs:?}");
        assert!(msgs[1].contains("gave up"), "{msgs:?}");
        assert!(s.join().unwrap().is_err());
    }

    #[test]
    fn a_one_rank_world_needs_nobody() {
        // With a peer to wait for, the same call would sit out its whole 30 s timeout.
        let server = Server::bind("127.0.0.1:0").unwrap();
        let t = Instant::now();
        assert!(server.serve(1, b"id", Duration::from_secs(30)).is_ok());
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        // Two ranks and nobody connecting: refused once the timeout passes.
        let server = Server::bind("127.0.0.1:0").unwrap();
        let e = server
            .serve(2, b"id", Duration::from_millis(50))
            .unwrap_err();
        assert!(e.to_string().contains("rank"), "{e}");
    }

    /// Ids round-trip in order; a payload of another length than the plan's count is refused
    /// with both sizes named, and too many ids for the rendezvous are refused when encoding.
    #[test]
    fn nccl_ids_round_trip_and_a_bad_length_is_an_error() {
        let ids: Vec<[u8; NCCL_ID_BYTES]> = (0..3u8).map(|i| [i + 1; NCCL_ID_BYTES]).collect();
        let bytes = encode_ids(&ids).unwrap();
        assert_eq!(bytes.len(), 3 * 128);
        assert_eq!((bytes[0], bytes[128], bytes[383]), (1, 2, 3));
        assert_eq!(decode_ids(&bytes, 3).unwrap(), ids);
        let e = decode_ids(&bytes, 4).unwrap_err().to_string();
        assert!(e.contains("sent 384 bytes"), "{e}");
        assert!(e.contains("expects 4 communicators"), "{e}");
        assert!(e.contains("(512 bytes)"), "{e}");
        assert!(decode_ids(&bytes[..200], 2).is_err());
        assert_eq!(decode_ids(&[], 0).unwrap(), Vec::<[u8; 128]>::new());
        let many = vec![[0u8; NCCL_ID_BYTES]; MAX_PAYLOAD / NCCL_ID_BYTES + 1];
        let e = encode_ids(&many).unwrap_err().to_string();
        assert!(e.contains("8193 NCCL communicators"), "{e}");
        assert!(encode_ids(&many[1..]).is_ok());
    }
}
