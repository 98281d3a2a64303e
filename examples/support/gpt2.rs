//! GPT-2-small decoding one token at a time (batch 1, fp32, KV cache), as a launch-bound workload (issue 11):
//! random weights with GPT-2's shapes, the kernels of `kernels/gpt2.cu` launched through APEX's public API, and a
//! CPU reference of the same arithmetic to check them. Shared by `examples/gpt2.rs` and `tests/gpu_gpt2.rs`.

#![allow(dead_code)] // each user takes the parts it needs

use apex::{Arg, Buffer, Gpu, Graph, Kernel, LaunchConfig, Queue};

/// The decoder kernels (`kernels/gpt2.cu`, nvcc -cubin -O3 -arch=sm_90).
pub const CUBIN: &[u8] = include_bytes!("../../kernels/gpt2.sm_90.cubin");

/// Model shape.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub vocab: usize,
    pub d: usize,
    pub layers: usize,
    pub heads: usize,
    pub ctx: usize,
}

/// GPT-2 small: 12 layers, d_model 768, 12 heads, 1024 positions, 50257 tokens.
pub const GPT2_SMALL: Shape = Shape {
    vocab: 50257,
    d: 768,
    layers: 12,
    heads: 12,
    ctx: 1024,
};

impl Shape {
    fn hd(&self) -> usize {
        self.d / self.heads
    }
    /// Splits of the KV cache the attention kernel works on at once (64 positions each, its block's size).
    fn splits(&self) -> usize {
        self.ctx.div_ceil(64)
    }
    /// Floats of one layer's parameters, in the order of [`LayerOffsets`].
    fn layer_floats(&self) -> usize {
        let d = self.d;
        2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d + 4 * d * d + 4 * d + 4 * d * d + d
    }
    /// Floats of every parameter: embeddings, layers, final layernorm.
    pub fn floats(&self) -> usize {
        self.vocab * self.d + self.ctx * self.d + self.layers * self.layer_floats() + 2 * self.d
    }
}

/// Where one layer's parameters start, in floats from the start of the parameter block.
#[derive(Clone, Copy, Debug)]
struct LayerOffsets {
    ln1_g: usize,
    ln1_b: usize,
    w_qkv: usize,
    b_qkv: usize,
    w_proj: usize,
    b_proj: usize,
    ln2_g: usize,
    ln2_b: usize,
    w_fc: usize,
    b_fc: usize,
    w_fc2: usize,
    b_fc2: usize,
}

/// The parameter block's layout: `wte [vocab][d]`, `wpe [ctx][d]`, the layers, `lnf_g`, `lnf_b`. Matrices are
/// row-major `[out][in]`.
#[derive(Clone, Debug)]
struct Layout {
    wte: usize,
    wpe: usize,
    layers: Vec<LayerOffsets>,
    lnf_g: usize,
    lnf_b: usize,
}

fn layout(s: &Shape) -> Layout {
    let d = s.d;
    let mut at = 0;
    let mut take = |n: usize| {
        let o = at;
        at += n;
        o
    };
    let wte = take(s.vocab * d);
    let wpe = take(s.ctx * d);
    let layers = (0..s.layers)
        .map(|_| LayerOffsets {
            ln1_g: take(d),
            ln1_b: take(d),
            w_qkv: take(3 * d * d),
            b_qkv: take(3 * d),
            w_proj: take(d * d),
            b_proj: take(d),
            ln2_g: take(d),
            ln2_b: take(d),
            w_fc: take(4 * d * d),
            b_fc: take(4 * d),
            w_fc2: take(4 * d * d),
            b_fc2: take(d),
        })
        .collect();
    let lnf_g = take(d);
    let lnf_b = take(d);
    Layout {
        wte,
        wpe,
        layers,
        lnf_g,
        lnf_b,
    }
}

/// Random parameters with GPT-2's initialisation scale (uniform with standard deviation 0.02; layernorm gains
/// near 1), from a fixed seed.
pub fn random_weights(s: &Shape, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Uniform in [-1, 1) from the top 24 bits.
        ((state >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    };
    // Uniform on [-a, a] has standard deviation a / sqrt(3).
    let scale = 0.02 * 3f32.sqrt();
    let mut w: Vec<f32> = (0..s.floats()).map(|_| next() * scale).collect();
    let l = layout(s);
    let gains = l
        .layers
        .iter()
        .flat_map(|o| [o.ln1_g, o.ln2_g])
        .chain([l.lnf_g]);
    for g in gains {
        for v in &mut w[g..g + s.d] {
            *v += 1.0;
        }
    }
    w
}

/// A token sequence to decode (teacher forcing: step `p` reads `tokens[p]`).
pub fn tokens(s: &Shape, seed: u32) -> Vec<i32> {
    (0..s.ctx as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) as i32 & 0x7fff_ffff)
        .map(|t| t % s.vocab as i32)
        .collect()
}

// ---- CPU reference ------------------------------------------------------------------------------------------

fn layernorm(x: &[f32], g: &[f32], b: &[f32]) -> Vec<f32> {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let rstd = 1.0 / (var + 1e-5).sqrt();
    x.iter()
        .zip(g.iter().zip(b))
        .map(|(v, (g, b))| (v - mean) * rstd * g + b)
        .collect()
}

fn matvec(w: &[f32], bias: Option<&[f32]>, x: &[f32], rows: usize) -> Vec<f32> {
    let cols = x.len();
    (0..rows)
        .map(|r| {
            let row = &w[r * cols..(r + 1) * cols];
            let dot: f64 = row.iter().zip(x).map(|(a, b)| f64::from(a * b)).sum();
            dot as f32 + bias.map_or(0.0, |b| b[r])
        })
        .collect()
}

fn gelu(v: f32) -> f32 {
    0.5 * v * (1.0 + (0.797_884_6 * (v + 0.044715 * v * v * v)).tanh())
}

/// The CPU model: the same arithmetic as the kernels, with its own KV cache.
pub struct CpuModel<'a> {
    s: Shape,
    w: &'a [f32],
    l: Layout,
    /// Per layer: keys and values of every position so far, `[pos][d]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl<'a> CpuModel<'a> {
    /// A model over parameters `w` (as [`random_weights`] lays them out).
    pub fn new(s: Shape, w: &'a [f32]) -> CpuModel<'a> {
        CpuModel {
            s,
            w,
            l: layout(&s),
            k: vec![Vec::new(); s.layers],
            v: vec![Vec::new(); s.layers],
        }
    }

    /// One decoding step at position `pos` (the next one) for `token`: the logits.
    pub fn step(&mut self, token: i32, pos: usize) -> Vec<f32> {
        let (s, w, d) = (self.s, self.w, self.s.d);
        let p = |o: usize, n: usize| &w[o..o + n];
        let t = token as usize;
        let mut x: Vec<f32> = (0..d)
            .map(|i| w[self.l.wte + t * d + i] + w[self.l.wpe + pos * d + i])
            .collect();
        let hd = s.hd();
        for (li, o) in self.l.layers.iter().enumerate() {
            let h = layernorm(&x, p(o.ln1_g, d), p(o.ln1_b, d));
            let qkv = matvec(p(o.w_qkv, 3 * d * d), Some(p(o.b_qkv, 3 * d)), &h, 3 * d);
            self.k[li].extend_from_slice(&qkv[d..2 * d]);
            self.v[li].extend_from_slice(&qkv[2 * d..]);
            let mut att = vec![0f32; d];
            for head in 0..s.heads {
                let q = &qkv[head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (0..=pos)
                    .map(|tp| {
                        let k = &self.k[li][tp * d + head * hd..tp * d + (head + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|v| (v - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                for i in 0..hd {
                    att[head * hd + i] = (0..=pos)
                        .map(|tp| e[tp] * self.v[li][tp * d + head * hd + i])
                        .sum::<f32>()
                        / sum;
                }
            }
            let proj = matvec(p(o.w_proj, d * d), Some(p(o.b_proj, d)), &att, d);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
            let h = layernorm(&x, p(o.ln2_g, d), p(o.ln2_b, d));
            let fc: Vec<f32> = matvec(p(o.w_fc, 4 * d * d), Some(p(o.b_fc, 4 * d)), &h, 4 * d)
                .into_iter()
                .map(gelu)
                .collect();
            let out = matvec(p(o.w_fc2, 4 * d * d), Some(p(o.b_fc2, d)), &fc, d);
            x.iter_mut().zip(&out).for_each(|(a, b)| *a += b);
        }
        let h = layernorm(&x, p(self.l.lnf_g, d), p(self.l.lnf_b, d));
        matvec(p(self.l.wte, s.vocab * d), None, &h, s.vocab)
    }
}

// ---- the GPU model --------------------------------------------------------------------------------------------

/// The decoder's kernels, by name.
pub struct Kernels {
    pub embed: Kernel,
    pub layernorm: Kernel,
    pub matvec: Kernel,
    pub attention: Kernel,
    pub attention_combine: Kernel,
    pub gelu: Kernel,
    pub residual: Kernel,
    pub advance: Kernel,
}

impl Kernels {
    /// Loads `kernels/gpt2.cu`'s cubin on `gpu`.
    pub fn load(gpu: &Gpu) -> apex::Result<Kernels> {
        let m = gpu.load_module(CUBIN)?;
        Ok(Kernels {
            embed: m.kernel("gpt2_embed")?,
            layernorm: m.kernel("gpt2_layernorm")?,
            matvec: m.kernel("gpt2_matvec")?,
            attention: m.kernel("gpt2_attention")?,
            attention_combine: m.kernel("gpt2_attention_combine")?,
            gelu: m.kernel("gpt2_gelu")?,
            residual: m.kernel("gpt2_residual")?,
            advance: m.kernel("gpt2_advance")?,
        })
    }
}

/// How [`GpuModel::launch_step`] sends a step's launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepLaunch {
    /// One launch (one doorbell) at a time, each after the one before has completed.
    Eager,
    /// One launch at a time, each a programmatic dependent launch of the one before (`apex::Launch::programmatic`).
    Programmatic,
    /// The step as one GPU-scheduled chain.
    Chained,
    /// The step as one GPU-scheduled chain whose links after the first are programmatic dependents of the link
    /// before (`apex::Launch::chained` and `apex::Launch::programmatic`).
    ChainedProgrammatic,
}

/// Which kernel a launch runs (an index into [`Kernels`], so a step can be replayed on another backend's kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Embed,
    LayerNorm,
    MatVec,
    Attention,
    AttentionCombine,
    Gelu,
    Residual,
    Advance,
}

impl Kernels {
    pub fn get(&self, w: Which) -> &Kernel {
        match w {
            Which::Embed => &self.embed,
            Which::LayerNorm => &self.layernorm,
            Which::MatVec => &self.matvec,
            Which::Attention => &self.attention,
            Which::AttentionCombine => &self.attention_combine,
            Which::Gelu => &self.gelu,
            Which::Residual => &self.residual,
            Which::Advance => &self.advance,
        }
    }
}

/// One launch of a step: the kernel, its shape and its arguments (device addresses and sizes).
#[derive(Clone, Debug)]
pub struct Launch {
    pub kernel: Which,
    pub cfg: LaunchConfig,
    pub args: Vec<Arg<'static>>,
}

/// The model's buffers on one GPU: parameters, activations, KV cache, the step state and the token sequence.
pub struct GpuModel {
    pub s: Shape,
    pub params: Buffer,
    pub acts: Buffer,
    pub cache: Buffer,
    /// `state[0]`: the position the next step decodes.
    pub state: Buffer,
    pub tokens: Buffer,
    /// The launches of one decoding step, in order (each depends on the one before).
    pub step: Vec<Launch>,
    logits_at: u64,
}

const THREADS: u32 = 256;

impl GpuModel {
    /// Uploads `w` and `tokens` to `gpu` and builds one step's launches.
    pub fn new(
        gpu: &Gpu,
        q: &mut Queue,
        s: Shape,
        w: &[f32],
        tokens: &[i32],
    ) -> apex::Result<GpuModel> {
        let d = s.d;
        if s.hd() != 64 || !s.ctx.is_multiple_of(64) {
            return Err(apex::Error::InvalidArgument(format!(
                "the decoder kernels take heads of 64 dimensions and a context in steps of 64, not {s:?}"
            )));
        }
        let f = |n: usize| (n * 4) as u64;
        let params = gpu.alloc(f(s.floats()))?;
        // x, h, qkv, att, tmp, fc, logits, attention partials
        let act_floats =
            d + d + 3 * d + d + d + 4 * d + s.vocab + s.heads * s.splits() * (2 + s.hd());
        let acts = gpu.alloc(f(act_floats))?;
        let cache = gpu.alloc(f(2 * s.layers * s.ctx * d))?;
        let state = gpu.alloc(64)?;
        let tokens_buf = gpu.alloc(f(s.ctx))?;
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // In pieces: one staging copy of the whole 500 MB would double the host memory for nothing.
        for (i, chunk) in w.chunks(16 << 20).enumerate() {
            q.upload(gpu, &params, f(i * (16 << 20)), &bytes(chunk))?;
        }
        let tb: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        q.upload(gpu, &tokens_buf, 0, &tb)?;
        let mut m = GpuModel {
            s,
            params,
            acts,
            cache,
            state,
            tokens: tokens_buf,
            step: Vec::new(),
            logits_at: 0,
        };
        m.build();
        m.set_position(gpu, q, 0)?;
        Ok(m)
    }

    fn build(&mut self) {
        let s = self.s;
        let d = s.d;
        let l = layout(&s);
        let pb = self.params.device_ptr();
        let par = |o: usize| Arg::Ptr(pb + (o * 4) as u64);
        let ab = self.acts.device_ptr();
        let mut at = 0u64;
        let mut act = |n: usize| {
            let p = ab + at * 4;
            at += n as u64;
            p
        };
        let (x, h, qkv, att, tmp, fc) = (act(d), act(d), act(3 * d), act(d), act(d), act(4 * d));
        let logits = act(s.vocab);
        let part = act(s.heads * s.splits() * (2 + s.hd()));
        self.logits_at = logits - ab;
        let state = Arg::Ptr(self.state.device_ptr());
        let warps = THREADS / 32;
        let mv =
            |w: Arg<'static>, b: Option<Arg<'static>>, x: u64, y: u64, cols: usize, rows: usize| {
                Launch {
                    kernel: Which::MatVec,
                    cfg: LaunchConfig::linear((rows as u32).div_ceil(warps), THREADS),
                    args: vec![
                        w,
                        b.unwrap_or(Arg::Ptr(0)),
                        Arg::Ptr(x),
                        Arg::Ptr(y),
                        Arg::I32(cols as i32),
                        Arg::I32(rows as i32),
                    ],
                }
            };
        let ln = |x: u64, g: usize, b: usize, y: u64| Launch {
            kernel: Which::LayerNorm,
            cfg: LaunchConfig::linear(1, THREADS),
            args: vec![Arg::Ptr(x), par(g), par(b), Arg::Ptr(y), Arg::I32(d as i32)],
        };
        let elementwise = |n: usize| LaunchConfig::linear((n as u32).div_ceil(THREADS), THREADS);
        let mut v = vec![Launch {
            kernel: Which::Embed,
            cfg: elementwise(d),
            args: vec![
                state,
                Arg::Ptr(self.tokens.device_ptr()),
                par(l.wte),
                par(l.wpe),
                Arg::Ptr(x),
                Arg::I32(d as i32),
            ],
        }];
        let splits = s.splits() as u32;
        let layer_cache = (s.ctx * d * 4) as u64;
        for (li, o) in l.layers.iter().enumerate() {
            let kc = self.cache.device_ptr() + 2 * li as u64 * layer_cache;
            v.push(ln(x, o.ln1_g, o.ln1_b, h));
            v.push(mv(par(o.w_qkv), Some(par(o.b_qkv)), h, qkv, d, 3 * d));
            v.push(Launch {
                kernel: Which::Attention,
                cfg: LaunchConfig::linear(1, 128).with_grid([s.heads as u32, splits, 1]),
                args: vec![
                    Arg::Ptr(qkv),
                    Arg::Ptr(kc),
                    Arg::Ptr(kc + layer_cache),
                    Arg::Ptr(part),
                    state,
                    Arg::I32(s.heads as i32),
                    Arg::I32(s.ctx as i32),
                ],
            });
            v.push(Launch {
                kernel: Which::AttentionCombine,
                cfg: LaunchConfig::linear(s.heads as u32, s.hd() as u32),
                args: vec![Arg::Ptr(part), Arg::Ptr(att), Arg::I32(splits as i32)],
            });
            v.push(mv(par(o.w_proj), Some(par(o.b_proj)), att, tmp, d, d));
            v.push(Launch {
                kernel: Which::Residual,
                cfg: elementwise(d),
                args: vec![Arg::Ptr(x), Arg::Ptr(tmp), Arg::I32(d as i32)],
            });
            v.push(ln(x, o.ln2_g, o.ln2_b, h));
            v.push(mv(par(o.w_fc), Some(par(o.b_fc)), h, fc, d, 4 * d));
            v.push(Launch {
                kernel: Which::Gelu,
                cfg: elementwise(4 * d),
                args: vec![Arg::Ptr(fc), Arg::I32(4 * d as i32)],
            });
            v.push(mv(par(o.w_fc2), Some(par(o.b_fc2)), fc, tmp, 4 * d, d));
            v.push(Launch {
                kernel: Which::Residual,
                cfg: elementwise(d),
                args: vec![Arg::Ptr(x), Arg::Ptr(tmp), Arg::I32(d as i32)],
            });
        }
        v.push(ln(x, l.lnf_g, l.lnf_b, h));
        v.push(mv(par(l.wte), None, h, logits, d, s.vocab));
        v.push(Launch {
            kernel: Which::Advance,
            cfg: LaunchConfig::linear(1, 32),
            args: vec![state],
        });
        self.step = v;
    }

    /// Sets the position the next step decodes (the KV cache below it is whatever earlier steps left).
    pub fn set_position(&self, gpu: &Gpu, q: &mut Queue, pos: usize) -> apex::Result<()> {
        q.upload(gpu, &self.state, 0, &(pos as i32).to_le_bytes())
    }

    /// One step on `q`, each launch waiting for the one before, sent as `how` says.
    ///
    /// # Safety
    /// `k` must be this model's kernels on `q`'s GPU, and nothing else may use the model's buffers meanwhile.
    pub unsafe fn launch_step(
        &self,
        q: &mut Queue,
        k: &Kernels,
        how: StepLaunch,
    ) -> apex::Result<()> {
        for (i, l) in self.step.iter().enumerate() {
            // SAFETY: the launches address only the model's buffers, sized for them (the caller's promise for the
            // rest); every kernel runs griddepcontrol.wait before it touches them.
            unsafe {
                let launch = apex::Launch::new(k.get(l.kernel), &l.cfg, &l.args);
                match how {
                    StepLaunch::Eager => drop(q.launch(k.get(l.kernel), &l.cfg, &l.args)?),
                    StepLaunch::Chained => q.submit(&launch.chained()).map(drop)?,
                    // The step's first launch heads the chain; it waits for whatever came before as usual.
                    StepLaunch::ChainedProgrammatic if i == 0 => {
                        q.submit(&launch.chained()).map(drop)?
                    }
                    StepLaunch::ChainedProgrammatic => {
                        q.submit(&launch.chained().programmatic()).map(drop)?
                    }
                    // The step's first launch follows the previous step's last (or whatever the caller did in
                    // between): programmatic too, the queue decides whether it can start early.
                    StepLaunch::Programmatic => drop(q.submit_fenced(&launch.programmatic())?),
                }
            }
        }
        if matches!(how, StepLaunch::Chained | StepLaunch::ChainedProgrammatic) {
            q.end_chain()?;
        }
        Ok(())
    }

    /// One step as a launch graph: every launch reads the parameters and tokens and writes the activations, the
    /// cache and the state, so the derived dependencies make it the same chain the step is. `programmatic`: every
    /// launch after the first is a programmatic consumer (the kernels start with `griddepcontrol.wait`).
    pub fn graph(&self, k: &Kernels, programmatic: bool) -> apex::Result<Graph> {
        let mut g = Graph::new();
        for (i, l) in self.step.iter().enumerate() {
            let node = g
                .launch(k.get(l.kernel), l.cfg, &l.args)?
                .reads(&self.params)
                .reads(&self.tokens)
                .writes(&self.acts)
                .writes(&self.cache)
                .writes(&self.state);
            if programmatic && i > 0 {
                node.programmatic();
            }
        }
        Ok(g)
    }

    /// The logits of the last step.
    pub fn logits(&self, gpu: &Gpu, q: &mut Queue) -> apex::Result<Vec<f32>> {
        let mut out = vec![0u8; self.s.vocab * 4];
        q.download(gpu, &self.acts, self.logits_at, &mut out)?;
        Ok(out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

/// Largest difference between `got` and `want`, relative to the largest magnitude in `want`.
pub fn max_rel_diff(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}
