"""Emulate the GPU executor's rounding points on the cpu reference (SmolLM2, build/smollm2), to see which
rounding moves the logits: `python experiments/emulate_rounding.py CONFIG...` (the configs are named below)."""
import sys, numpy as np
sys.path.insert(0, '.')
from imp_runtime.engine import Engine
from imp_runtime.executor_cpu import CpuExecutor, rms_norm, gated_act, attention
from imp_runtime.rope import apply_rope, cos_sin

def bf(a):
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return r.view(np.float32).reshape(np.shape(a))
def split(a):
    h = bf(a); return h + bf(a - h)

class Emu(CpuExecutor):
    cfg = {}
    def rin(self, a, t):
        mode = self.cfg['pin'] if t > 1 else self.cfg['din']
        return {'bf16': bf, 'split': split, 'none': lambda x: x, 'f16': lambda x: x.astype(np.float16).astype(np.float32)}[mode](a)
    def _forward(self, seq, tokens):
        s, w, c = self.spec, self.w, self.cfg
        t, start = len(tokens), seq.length
        pos = np.arange(start, start + t)
        self._reserve(seq, start + t)
        x = w["embed"][tokens] * np.float32(s.embed_scale)
        for i in range(s.n_layers):
            p = f"layers.{i}."
            a = self.rin(rms_norm(x, w[p + "attn_norm"], s.norm_eps), t)
            qkv = a @ w[p + "qkv"].T
            q = qkv[:, :s.q_dim].reshape(t, s.n_heads, s.head_dim)
            k = qkv[:, s.q_dim:s.q_dim + s.kv_dim].reshape(t, s.n_kv_heads, s.head_dim)
            v = qkv[:, s.q_dim + s.kv_dim:].reshape(t, s.n_kv_heads, s.head_dim)
            cos, sin = cos_sin(s, i, pos)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if c['q'] is True: q = bf(q)
            if c['kv'] == 'f16': k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
            elif c['kv']: k, v = bf(k), bf(v)
            if c['q'] == 'f16': q = q.astype(np.float16).astype(np.float32)
            seq.k[i][start:start + t] = k
            seq.v[i][start:start + t] = v
            o = attention(q, seq.k[i][:start + t], seq.v[i][:start + t], pos, s.softmax_scale, 0)
            o = self.rin(o.reshape(t, s.q_dim), t) @ w[p + "o"].T
            x = x + o
            m = self.rin(rms_norm(x, w[p + "ffn_norm"], s.norm_eps), t)
            m = self.rin(gated_act(m @ w[p + "gate_up"].T, s.activation), t) @ w[p + "down"].T
            x = x + m
        seq.length = start + t
        return x
    def _logits(self, h):
        s = self.spec
        hn = rms_norm(h, self.w["final_norm"], s.norm_eps)
        hn = self.rin(hn, len(h)) if self.cfg.get('head', True) else hn
        return hn @ self.head.T

PROMPTS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain gravity to a child."]
eng = Engine('build/smollm2', device='cpu', verify=False)
ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
def greedy(ex, n=32):
    outs, gaps = [], []
    for pid in ids:
        sid = ex.new_sequence()
        l = ex.prefill(sid, pid); o = [int(np.argmax(l))]; g=[]
        for _ in range(n - 1):
            l = ex.decode([sid], [o[-1]])[0]; srt = np.sort(l); g.append(srt[-1]-srt[-2])
            o.append(int(np.argmax(l)))
        ex.free(sid); outs.append(o); gaps.append(g)
    return outs, gaps
ref = CpuExecutor(eng.bundle)
R, G = greedy(ref)
for i,g in enumerate(G): print('ref min gaps', i, np.round(sorted(g)[:3],4), 'argmin step', int(np.argmin(g))+1)
configs = {
 'current': dict(pin='bf16', din='bf16', q=True, kv=True),
 'dec_fp32': dict(pin='bf16', din='none', q=True, kv=True),
 'dec_split': dict(pin='bf16', din='split', q=True, kv=True),
 'dec_split_q32': dict(pin='bf16', din='split', q=False, kv=True),
 'all_split': dict(pin='split', din='split', q=True, kv=True),
 'all_split_q32': dict(pin='split', din='split', q=False, kv=True),
 'all_split_kv32': dict(pin='split', din='split', q=False, kv=False),
 'dec_split_kv16_q16': dict(pin='bf16', din='split', q='f16', kv='f16'),
 'all_split_kv16_q16': dict(pin='split', din='split', q='f16', kv='f16'),
 'p16_dsplit_kv16_q16': dict(pin='f16', din='split', q='f16', kv='f16'),
}
def forced(ex, outs):
    L = []
    for pid, o in zip(ids, outs):
        sid = ex.new_sequence(); rows = [ex.prefill(sid, pid)]
        for tk in o[:-1]: rows.append(ex.decode([sid], [tk])[0])
        ex.free(sid); L.append(np.array(rows))
    return L
RL = forced(ref, R)
for name in sys.argv[1:] or configs:
    e = Emu(eng.bundle); e.cfg = configs[name]
    EL = forced(e, R)
    res = []
    for r, el, o in zip(RL, EL, R):
        d = np.abs(el - r).max()
        # margin of the ref winner in the emulation, min over steps
        idx = np.arange(len(o))
        win = el[idx, o]; tmp = el.copy(); tmp[idx, o] = -np.inf
        res.append((round(float(d),4), round(float((win - tmp.max(1)).min()),4)))
    print(name, res, flush=True)
