"""Redraws docs/figures/cp_pp.png from the plan explorer's CP and PP prices: python docs/figures/cp_pp.py"""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from pallasite.tools.plan import inputs as pi, parallel as pp
cl = pi.Cluster(pi.GPUS["h100"])
wl = pi.Workload()
m8 = pi.load_model("llama-3-8b")
m70 = pi.load_model("llama-3-70b")
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
prompts = [16384, 32768, 65536, 131072, 262144, 524288]
for cp in (1, 2, 4, 8):
    t = [pp.cp_prefill(m8, cl, wl, p, cp).ttft_s for p in prompts]
    a.plot([p / 1024 for p in prompts], t, marker="o", label=f"cp={cp}")
a.set_xscale("log", base=2); a.set_yscale("log")
a.set_xlabel("prompt (k tokens)"); a.set_ylabel("predicted TTFT (s)")
a.set_title("CP prefill, Llama-3-8B shape, H100"); a.legend(); a.grid(alpha=.3)
ms = [1, 2, 4, 8]
batches = [8, 16, 32, 64, 128, 256]
for m in (2, 4):
    b.plot(batches, [pp.pp_step(m70, cl, wl, B, 4096, 2, 1, micro_batches=m).steady_tokens_per_s for B in batches], marker="o", label=f"PP=2 x TP=1, {m} micro-batches, pipe kept full")
    b.plot(batches, [pp.pp_step(m70, cl, wl, B, 4096, 2, 1, micro_batches=m).tokens_per_s for B in batches], marker="x", ls=":", label=f"PP=2 x TP=1, {m} micro-batches, fill and drain")
b.plot(batches, [pp.pp_step(m70, cl, wl, B, 4096, 1, 2).tokens_per_s for B in batches], "k--", label="TP=2")
b.set_xscale("log", base=2); b.set_xlabel("decode batch"); b.set_ylabel("predicted tokens/s")
b.set_title("Llama-3-70B shape, 2 H100s, context 4k"); b.legend(fontsize=7); b.grid(alpha=.3)
fig.tight_layout(); fig.savefig("docs/figures/cp_pp.png", dpi=90)
for cp in (1,2,4,8):
    c = pp.cp_prefill(m8, cl, wl, 131072, cp)
    print(cp, round(c.ttft_s,3), round(c.ring_s,3), round(c.ring_exposed_s,3), round(c.kv_gather_s,3))
for B in (8, 64):
  for m in (2,4):
    c = pp.pp_step(m70, cl, wl, B, 4096, 2, 1, micro_batches=m); print(B, m, round(c.steady_tokens_per_s), round(c.tokens_per_s), round(c.weights_gib,1))
  print("tp2", round(pp.pp_step(m70, cl, wl, B, 4096, 1, 2).tokens_per_s))
