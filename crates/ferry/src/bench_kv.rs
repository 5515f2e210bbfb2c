//! `ferry bench kv`: KV transfer throughput between two processes on loopback, for each transport,
//! against raw loopback TCP measured in the same run (the physical ceiling here).
//!
//! The parent starts `ferry bench kv-sink` as a child process: a real KV receiver (the decode
//! worker's assembler: CRC, order and size checks, copy into the payload) that discards each
//! payload once validated, plus a raw TCP sink. The parent sends the same bytes through
//! `ferry_worker::kv::send::push` (exactly what a prefill worker runs) and as plain 4 MiB writes.
//!
//! With `--device cuda[:N]` the layers also start in device memory, as a GPU prefill worker
//! exports them, and go over the CUDA IPC pipe (`--kv-transport cuda-ipc`: the sink exports its
//! receive buffer, this process copies into it on the GPU, both sides checksum on the device);
//! the ceiling then is the device's own copy of the same bytes, measured in the same run.

use anyhow::Context;
use bytes::Bytes;
use ferry_core::{KvDtype, KvLayout, KvPayloadHeader};
use ferry_engine::bench::median;
use ferry_proto::v1::{KvBegin, KvTarget};
use ferry_worker::kv::receive::{KvReceiver, KvTransferService};
use ferry_worker::kv::send::{self as transport, GrpcTransport, KvTransport, TcpTransport, H2_WINDOW, MAX_MESSAGE_BYTES};
use ferry_worker::kv::Outbound;
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(clap::Args, Debug)]
pub struct KvBenchArgs {
    /// Tokens of KV per transfer (SmolLM2-135M's layout: 30 layers, 3 KV heads of 64, f32).
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    #[arg(long, default_value_t = 30)]
    pub layers: usize,
    #[arg(long, default_value_t = 3)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    /// `cuda[:N]`: also measure the CUDA IPC pipe from device memory (needs a GPU build).
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: ferry_engine::Device,
    /// The stored KV type the payload carries (its rows: f32 256 bytes per 64 values, bf16/f16
    /// 128, int8 68 with its scale); `bytes_per_token` reports what ships.
    #[arg(long, default_value = "f32", value_parser = crate::parse_kv_dtype)]
    pub kv_dtype: KvDtype,
}

#[derive(clap::Args, Debug)]
pub struct KvSinkArgs {
    #[arg(long, default_value = "f32", value_parser = crate::parse_kv_dtype)]
    pub kv_dtype: KvDtype,
    /// `cuda[:N]`: also accept CUDA IPC pipes, receiving into this device's memory.
    #[arg(long, default_value = "cpu", value_parser = crate::parse_device)]
    pub device: ferry_engine::Device,
    #[arg(long)]
    pub layers: usize,
    #[arg(long)]
    pub kv_heads: usize,
    #[arg(long)]
    pub head_dim: usize,
}

fn layout(dtype: KvDtype, layers: usize, kv_heads: usize, head_dim: usize) -> KvLayout {
    KvLayout { dtype, block_size: 16, n_layers: layers, n_kv_heads: kv_heads, head_dim }
}

const FINGERPRINT: &str = "ferry-bench-kv";

/// The child: serve a sink receiver over gRPC and TCP, and a raw TCP sink; print the addresses.
pub fn sink(a: KvSinkArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let receiver = KvReceiver::sink(FINGERPRINT.into(), layout(a.kv_dtype, a.layers, a.kv_heads, a.head_dim));
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let data = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let raw = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        println!("grpc={} data={} raw={}", grpc.local_addr()?, data.local_addr()?, raw.local_addr()?);
        tokio::spawn(ferry_worker::kv::receive::serve_tcp(receiver.clone(), data, ferry_worker::kv::DEFAULT_STALL, Default::default()));
        tokio::spawn(async move {
            while let Ok((mut s, _)) = raw.accept().await {
                tokio::spawn(async move {
                    // Read a length, then that many bytes into a reused buffer; answer one byte.
                    let n = match s.read_u64_le().await {
                        Ok(n) => n,
                        Err(_) => return,
                    };
                    let mut buf = vec![0u8; 4 << 20];
                    let mut left = n as usize;
                    while left > 0 {
                        let want = left.min(buf.len());
                        match s.read(&mut buf[..want]).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => left -= k,
                        }
                    }
                    let _ = s.write_u8(1).await;
                });
            }
        });
        let pipes = match a.device {
            ferry_engine::Device::Cuda(_) => crate::pipes::pipes(ferry_proto::v1::KvTransport::CudaIpc, a.device).map(|p| p.0),
            ferry_engine::Device::Cpu => None,
        };
        let svc = ferry_proto::v1::kv_transfer_server::KvTransferServer::new(KvTransferService::new(receiver, pipes, ferry_worker::kv::DEFAULT_STALL))
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        tonic::transport::Server::builder()
            .initial_stream_window_size(H2_WINDOW)
            .initial_connection_window_size(H2_WINDOW)
            .tcp_nodelay(true)
            .add_service(svc)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc).with_nodelay(Some(true)))
            .await?;
        anyhow::Ok(())
    })
}

async fn raw_tcp(addr: &str, bytes: usize) -> anyhow::Result<Duration> {
    let buf = vec![7u8; 4 << 20];
    let t = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    s.write_u64_le(bytes as u64).await?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        s.write_all(&buf[..n]).await?;
        left -= n;
    }
    anyhow::ensure!(s.read_u8().await? == 1, "raw sink did not confirm");
    Ok(t.elapsed())
}

async fn ferry_transfer(t: &dyn KvTransport, target: &KvTarget, lay: KvLayout, tokens: usize, layers: &[Bytes]) -> anyhow::Result<Duration> {
    // Checksums are computed as the engine exports each layer, before the transfer (see
    // `Outbound::layer`); they are outside the timed part, as the export itself is.
    let msgs: Vec<Outbound> = layers.iter().enumerate().map(|(l, d)| Outbound::layer((l * lay.layer_bytes(tokens)) as u64, d.clone())).collect();
    send(t, target, lay, tokens, msgs).await
}

/// The layers as device buffers on `device` (as a GPU prefill worker exports them), sent as
/// buffer frames.
async fn device_transfer(t: &dyn KvTransport, target: &KvTarget, lay: KvLayout, tokens: usize, layers: &[Bytes], device: ferry_engine::Device) -> anyhow::Result<Duration> {
    let mut msgs = Vec::new();
    for (l, d) in layers.iter().enumerate() {
        msgs.push(Outbound::Buffer { offset: (l * lay.layer_bytes(tokens)) as u64, buf: crate::pipes::device_buffer(device, d)? });
    }
    send(t, target, lay, tokens, msgs).await
}

async fn send(t: &dyn KvTransport, target: &KvTarget, lay: KvLayout, tokens: usize, msgs: Vec<Outbound>) -> anyhow::Result<Duration> {
    let header = KvPayloadHeader { layout: lay, tokens };
    let begin = KvBegin { transfer_token: "bench".into(), fingerprint: FINGERPRINT.into(), header: header.encode().to_vec().into(), request_id: "bench".into(), ..Default::default() };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let start = Instant::now();
    for m in msgs {
        let _ = tx.send(m);
    }
    let now = Instant::now();
    let _ = tx.send(Outbound::End {
        first_token: 0,
        first_is_stop: false,
        first_logprob: None,
        prompt_logprobs: Vec::new(),
        sampler_state: 0,
        more_choices: Vec::new(),
        queued: Duration::ZERO,
        computed: Duration::ZERO,
        computed_at: now,
        lease: Box::new(()),
    });
    transport::push(t, target, begin, &mut rx, ferry_worker::kv::DEFAULT_STALL).await?;
    Ok(start.elapsed())
}

pub fn run(a: KvBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.tokens >= 1 && a.repeats >= 1, "--tokens and --repeats must be at least 1");
    let exe = std::env::current_exe()?;
    let device = match a.device {
        ferry_engine::Device::Cuda(n) => format!("cuda:{n}"),
        ferry_engine::Device::Cpu => "cpu".into(),
    };
    let mut child = std::process::Command::new(exe)
        .args(["bench", "kv-sink", "--kv-dtype", a.kv_dtype.name(), "--layers", &a.layers.to_string(), "--kv-heads", &a.kv_heads.to_string(), "--head-dim", &a.head_dim.to_string(), "--device", &device])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the sink process")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("sink stdout")?).read_line(&mut line)?;
    let addr = |k: &str| line.split_whitespace().find_map(|f| f.strip_prefix(k)).map(str::to_string).context("sink did not print its addresses");
    let (grpc, data, raw) = (addr("grpc=")?, addr("data=")?, addr("raw=")?);
    let lay = layout(a.kv_dtype, a.layers, a.kv_heads, a.head_dim);
    let layers: Vec<Bytes> = (0..a.layers).map(|l| Bytes::from(vec![l as u8; lay.layer_bytes(a.tokens)])).collect();
    let bytes = KvPayloadHeader { layout: lay, tokens: a.tokens }.body_bytes();
    let target = KvTarget { decode_worker: "sink".into(), grpc_addr: grpc, data_addr: data, transfer_id: 1, transport: 0, transfer_token: "bench".into(), ..Default::default() };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let result = rt.block_on(async {
        let (tcp, grpc_t) = (TcpTransport::new(Default::default()), GrpcTransport::default());
        // Warm-up: connections, page faults.
        raw_tcp(&raw, bytes).await?;
        ferry_transfer(&tcp, &target, lay, a.tokens, &layers).await?;
        ferry_transfer(&grpc_t, &target, lay, a.tokens, &layers).await?;
        let (mut r, mut t, mut g) = (Vec::new(), Vec::new(), Vec::new());
        let gbps = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
        for _ in 0..a.repeats {
            r.push(gbps(raw_tcp(&raw, bytes).await?));
            t.push(gbps(ferry_transfer(&tcp, &target, lay, a.tokens, &layers).await?));
            g.push(gbps(ferry_transfer(&grpc_t, &target, lay, a.tokens, &layers).await?));
        }
        // The CUDA IPC pipe from device memory, and the device's own copy of the same bytes.
        let mut dev = serde_json::Map::new();
        if let ferry_engine::Device::Cuda(_) = a.device {
            let pipes = crate::pipes::pipes(ferry_proto::v1::KvTransport::CudaIpc, a.device).context("no CUDA IPC pipes on this device")?;
            let ipc = ferry_worker::kv::send::PipeTransport::new(pipes.0, ferry_worker::kv::send::Channels::new(None, Default::default()), "bench".into(), FINGERPRINT.into());
            let ipc_target = KvTarget { transport: ferry_proto::v1::KvTransport::CudaIpc as i32, ..target.clone() };
            device_transfer(&ipc, &ipc_target, lay, a.tokens, &layers, a.device).await?;
            let (mut i, mut tc, mut c) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..a.repeats {
                i.push(gbps(device_transfer(&ipc, &ipc_target, lay, a.tokens, &layers, a.device).await?));
                // TCP from device memory: the layers copied to the host first, as a GPU
                // prefill worker does for a host transport.
                tc.push(gbps(device_transfer(&tcp, &target, lay, a.tokens, &layers, a.device).await?));
                c.push(crate::pipes::device_copy_rate(a.device, bytes)? / 1e9);
            }
            let (i, tc, c) = (median(i), median(tc), median(c));
            dev.insert("device".into(), device.clone().into());
            dev.insert("ferry_cuda_ipc_gb_per_s".into(), i.into());
            dev.insert("ferry_tcp_from_device_gb_per_s".into(), tc.into());
            dev.insert("device_copy_gb_per_s".into(), c.into());
            dev.insert("ferry_cuda_ipc_vs_device_copy".into(), (i / c).into());
            dev.insert("ferry_cuda_ipc_vs_tcp_from_device".into(), (i / tc).into());
        }
        anyhow::Ok((median(r), median(t), median(g), dev))
    });
    let _ = child.kill();
    let _ = child.wait();
    let (raw_gbps, tcp_gbps, grpc_gbps, dev) = result?;
    let mut out = serde_json::json!({
        "bench": "kv",
        "tokens": a.tokens,
        "kv_dtype": a.kv_dtype.name(),
        "bytes": bytes,
        "bytes_per_token": bytes / a.tokens,
        "bytes_per_token_vs_f32": lay.bytes_per_token() as f64 / KvLayout { dtype: KvDtype::F32, ..lay }.bytes_per_token() as f64,
        "ferry_tcp_ms_per_transfer": bytes as f64 / tcp_gbps / 1e6,
        "repeats": a.repeats,
        "raw_tcp_gb_per_s": raw_gbps,
        "ferry_tcp_gb_per_s": tcp_gbps,
        "ferry_grpc_gb_per_s": grpc_gbps,
        "ferry_tcp_vs_raw": tcp_gbps / raw_gbps,
        "ferry_grpc_vs_raw": grpc_gbps / raw_gbps,
    });
    if let Some(o) = out.as_object_mut() {
        o.extend(dev);
    }
    println!("{out}");
    Ok(())
}
