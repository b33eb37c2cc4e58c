#!/usr/bin/env python3
"""projection.py: what GLM-5.2, Kimi K3 and Inkling would do on named machines.

A projection, not a measurement. For each model it counts, from the published
configuration, the bytes a decoded token reads (attention or KDA, the routed experts, the
shared experts, dense layers, the LM head, the state at a given context) and the
multiply-adds a prefilled token costs; for each machine class it places the routed experts
in VRAM, RAM or on disk by the memory each tier has, takes the hit rate the routing study
measured for that fraction of the experts, and divides:

    decode s/token  = RAM bytes / (RAM bandwidth x coli's measured fraction of it)
                    + VRAM bytes / (HBM bandwidth x the fraction assumed for the GPU)
                    + missed expert bytes / (disk bandwidth x coli's measured fraction)
    prefill s       = weight multiply-adds / (FMA peak x coli's measured fraction of it)
                    + attention's over the context / (FMA peak x its measured fraction)
                    + expert bytes not in memory / (disk bandwidth x measured fraction)

Every input is a constant below with where it comes from; `--markdown` prints the tables
docs/benchmarks.md holds. Only the standard library.
"""

import argparse

GB = 1e9

# ---- formats: bytes a parameter takes -------------------------------------------------
INT4_G64 = 0.5 + 4 / 64  # coli's int4-g64: a nibble, an f32 scale per 64 columns
MXFP4 = 0.5 + 1 / 32  # e2m1 nibbles, an E8M0 scale per 32
INT8_ROW = 1.0  # one f32 scale a row, negligible at these widths
F32 = 4.0

# ---- coli's measured fractions (docs/benchmarks.md, this machine) -------------------
# Decode of GLM-5.2 at its published width, int4-g64 experts with an int8 trunk: 89% of
# the measured read bandwidth over the whole token ("GLM-5.2 at its published width").
DECODE_OF_BW = 0.89
# Prefill of 512 tokens, int4-g64 experts: 26% of the f32 FMA peak with f32 activations,
# 42% with ACT_BITS=8 (same section).
PREFILL_OF_PEAK = {"f32": 0.26, "ACT_BITS=8": 0.42}
# Attention's products over the context (scores and weighted sums) in a prefill of GLM-5.2:
# 10-11% of the FMA peak at 4,096 tokens, where most rows read much of what precedes them,
# and 6% at 16,384, where most read an eighth to a quarter ("Against llama.cpp on the same
# weights, and 4,096-token prompts" and "16,384-token prompts"). A 10,000-token prompt's rows
# lie between the two: taken at 7.5%.
CONTEXT_OF_PEAK = 0.075
# The expert store reads at about 85% of the disk's bandwidth ("Out of core").
DISK_OF_BW = 0.85
# Assumed, not measured: GPU products at 70% of the card's bandwidth.
GPU_OF_BW = 0.70

# ---- the routing study's hit rates (docs/routing-telemetry.md, "Learned placement
# against LRU"; olmoe_trained, 32 experts top-4, the engine's default `guarded` policy,
# held-out text against its own domain's history), by the fraction of a layer's experts
# held: (prose, code).
HIT_RATE = {1 / 16: (0.193, 0.078), 1 / 8: (0.466, 0.250), 1 / 4: (0.719, 0.512), 1 / 2: (0.934, 0.833), 1.0: (1.0, 1.0)}


def hit_rate(held):
    """The study's hit rates at the largest measured fraction not above `held`."""
    best = max(f for f in HIT_RATE if f <= held + 1e-9) if held >= 1 / 16 else None
    return HIT_RATE[best] if best else (0.0, 0.0), best


def mlp(hidden, width):
    return 3 * hidden * width


def glm52():
    """GLM-5.2 (glm_moe_dsa): ../reference/glm_cli_formats.md section 3.1, from the HF config."""
    d, heads, q_lora, kv_lora, nope, rope, v = 6144, 64, 2048, 512, 192, 64, 256
    idx_heads, idx_dim = 32, 128
    layers, dense_layers = 78, 3
    attention = (
        q_lora * d
        + heads * (nope + rope) * q_lora
        + (kv_lora + rope) * d
        + heads * (nope + v) * kv_lora
        + d * heads * v
        + idx_heads * idx_dim * q_lora
        + idx_dim * d
        + idx_heads * d
    )
    moe = layers - dense_layers
    return {
        "name": "GLM-5.2",
        "format": "int4-g64 experts, int8 trunk",
        "expert_bytes": INT4_G64,
        "trunk_bytes": INT8_ROW,
        "attention": layers * attention,
        "routed_per_token": moe * 8 * mlp(d, 2048),
        "experts_total": moe * 256 * mlp(d, 2048),
        "shared": moe * mlp(d, 2048),
        "dense": dense_layers * mlp(d, 12288),
        "head": 154880 * d,
        # f32 state a token of context adds: MLA's latent and rotary key, the indexer's key.
        "state_per_token": layers * (kv_lora + rope + idx_dim) * 4,
        # Keys attention reads a step: every key up to the indexer's top-k, then top-k.
        "attended": lambda ctx: layers * min(ctx, 2048) * (kv_lora + rope) * 4 + layers * ctx * idx_dim * 4,
        "attention_macs": lambda ctx: layers * (min(ctx, 2048) * heads * (nope + rope + v) + ctx * idx_heads * idx_dim),
        "fixed_state": 0,
    }


def kimi_k3():
    """Kimi K3 (kimi_linear text config): ../reference/engines.md section 3.1."""
    d, layers, kda_layers = 7168, 93, 69
    mla_layers = layers - kda_layers
    heads, q_lora, kv_lora, nope, rope, v = 96, 1536, 512, 128, 64, 128
    kda_heads, kda_dim = 96, 128
    p = kda_heads * kda_dim
    mla = q_lora * d + heads * (nope + rope) * q_lora + (kv_lora + rope) * d + heads * (nope + v) * kv_lora + d * heads * v
    mla += d * heads * v  # the output gate (mla_use_output_gate)
    # q, k, v, the full-rank output gate, o; the gate's rank-128 pair; beta.
    kda = 4 * d * p + p * d + kda_dim * d + p * kda_dim + kda_heads * d
    latent, expert_width, moe = 3584, 3072, layers - 1
    return {
        "name": "Kimi K3",
        # The trunk as colibri's K3_BITS=4 default keeps it (the release's is bf16).
        "format": "MXFP4 experts as published, int4-g64 trunk",
        "expert_bytes": MXFP4,
        "trunk_bytes": INT4_G64,
        "attention": mla_layers * mla + kda_layers * kda,
        "routed_per_token": moe * (16 * mlp(latent, expert_width) + 2 * latent * d),
        "experts_total": moe * 896 * mlp(latent, expert_width),
        # The two shared experts fused: gate/up [6144, 7168], down [7168, 6144].
        "shared": moe * mlp(d, 6144),
        "dense": 1 * mlp(d, 33792),
        "head": 163840 * d,
        "state_per_token": mla_layers * (kv_lora + rope) * 4,
        "attended": lambda ctx: mla_layers * ctx * (kv_lora + rope) * 4,
        "attention_macs": lambda ctx: mla_layers * ctx * heads * (nope + rope + v),
        # KDA's recurrent state, a 128x128 f32 matrix per head, read and written every step.
        "fixed_state": 2 * kda_layers * kda_heads * kda_dim * kda_dim * 4,
    }


def inkling():
    """Inkling (975B): ../reference/engines.md section 2.1, the real text config."""
    d, layers, heads, head_dim = 6144, 66, 64, 128
    global_layers = layers // 6
    local_layers = layers - global_layers
    kv_global, kv_local, d_rel = 8, 16, 16

    def attention(kv):
        return d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + d * heads * d_rel

    return {
        "name": "Inkling",
        "format": "int4-g64 experts, int8 trunk",
        "expert_bytes": INT4_G64,
        "trunk_bytes": INT8_ROW,
        "attention": global_layers * attention(kv_global) + local_layers * attention(kv_local),
        "routed_per_token": (layers - 2) * 6 * mlp(d, 3072),
        "experts_total": (layers - 2) * 256 * mlp(d, 3072),
        "shared": (layers - 2) * 2 * mlp(d, 3072),
        "dense": 2 * mlp(d, 24576),
        "head": 201024 * d,
        "state_per_token": global_layers * 2 * kv_global * head_dim * 4,
        "attended": lambda ctx: global_layers * ctx * 2 * kv_global * head_dim * 4
        + local_layers * min(ctx, 512) * 2 * kv_local * head_dim * 4,
        "attention_macs": lambda ctx: global_layers * ctx * heads * 2 * head_dim
        + local_layers * min(ctx, 512) * heads * 2 * head_dim,
        "fixed_state": 0,
    }


# ---- machine classes ------------------------------------------------------------------
# Read bandwidth assumed at 80% of the channels' rate (what a read probe such as this
# repository's gets on current DDR5 machines; an assumption); FMA peaks from the cores'
# published vector units at their all-core clock.
EPYC = {
    "name": "64-core EPYC, 12-channel DDR5-4800, 512 GB, NVMe RAID0 17.9 GB/s",
    "ram_bw": 0.8 * 12 * 38.4 * GB,
    "ram": 512 * GB,
    "vram": 0,
    "disk_bw": 17.9 * GB,
    # Zen 4: two 256-bit FMA pipes, 16 f32 multiply-adds a cycle, ~3.1 GHz all-core.
    "fma": 64 * 16 * 3.1e9,
}
MACHINES = [
    EPYC,
    {**EPYC, "name": "the same EPYC at colibri's published 97% hits", "hits": (0.97, 0.97)},
    {**EPYC, "name": "the same EPYC with 256 GB", "ram": 256 * GB},
    {
        "name": "16-core desktop, dual-channel DDR5-6000, 128 GB, one NVMe 7 GB/s",
        "ram_bw": 0.8 * 2 * 48.0 * GB,
        "ram": 128 * GB,
        "vram": 0,
        "disk_bw": 7.0 * GB,
        # Zen 5: two 512-bit FMA pipes, 32 f32 multiply-adds a cycle, ~5.0 GHz all-core.
        "fma": 16 * 32 * 5.0e9,
    },
    {
        **EPYC,
        "name": "one H200 (141 GB, 4.8 TB/s) with 240 GB of RAM on the EPYC above, one NVMe 7 GB/s",
        "ram": 240 * GB,
        "vram": 141 * GB,
        "hbm_bw": 4.8e12,
        "disk_bw": 7.0 * GB,
    },
]

# Memory kept for the system, the server and the conversation states, not for experts.
RESERVED = 16 * GB


def place(model, machine):
    """Bytes of the trunk and expert fractions in VRAM, RAM and on disk."""
    trunk = (model["attention"] + model["shared"] + model["dense"] + model["head"]) * model["trunk_bytes"]
    experts = model["experts_total"] * model["expert_bytes"]
    vram_free = max(machine["vram"] - trunk - 8 * GB, 0) if machine["vram"] else 0
    ram_free = max(machine["ram"] - RESERVED - (0 if machine["vram"] else trunk), 0)
    in_vram = min(vram_free / experts, 1.0)
    in_ram = min(ram_free / experts, 1.0 - in_vram)
    return trunk, experts, in_vram, in_ram


def decode(model, machine, hits, ctx):
    trunk, experts, in_vram, in_ram = place(model, machine)
    routed = model["routed_per_token"] * model["expert_bytes"]
    state = model["attended"](ctx) + model["fixed_state"]
    held = in_vram + in_ram
    # Hits land in VRAM and RAM in proportion to what each holds.
    vram_share = in_vram / held if held else 0.0
    hit_bytes = routed * hits
    miss_bytes = routed * (1 - hits)
    seconds = miss_bytes / (machine["disk_bw"] * DISK_OF_BW)
    if machine["vram"]:
        seconds += (trunk + state + hit_bytes * vram_share) / (machine["hbm_bw"] * GPU_OF_BW)
        seconds += hit_bytes * (1 - vram_share) / (machine["ram_bw"] * DECODE_OF_BW)
    else:
        seconds += (trunk + state + hit_bytes) / (machine["ram_bw"] * DECODE_OF_BW)
    return seconds, trunk + state + routed, miss_bytes


def prefill(model, machine, tokens, activations):
    trunk, experts, in_vram, in_ram = place(model, machine)
    weights = model["attention"] + model["routed_per_token"] + model["shared"] + model["dense"]
    # Attention's products over the context, summed over the prompt's positions.
    step = max(tokens // 100, 1)
    context = sum(model["attention_macs"](p) * step for p in range(0, tokens, step))
    macs = tokens * weights + context + model["head"]
    compute = (macs - context) / (machine["fma"] * PREFILL_OF_PEAK[activations])
    compute += context / (machine["fma"] * CONTEXT_OF_PEAK)
    # One forward over the prompt reads every expert once: what memory does not hold
    # comes from disk (no overlap with compute assumed).
    from_disk = experts * max(1.0 - in_vram - in_ram, 0.0)
    return compute + from_disk / (machine["disk_bw"] * DISK_OF_BW), macs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="context of the decoded token")
    parser.add_argument("--prompt", type=int, default=10000, help="tokens of the projected prefill")
    parser.add_argument("--markdown", action="store_true", help="print docs/benchmarks.md's tables")
    args = parser.parse_args()

    for model in (glm52(), kimi_k3(), inkling()):
        trunk = (model["attention"] + model["shared"] + model["dense"] + model["head"]) * model["trunk_bytes"]
        routed = model["routed_per_token"] * model["expert_bytes"]
        experts = model["experts_total"] * model["expert_bytes"]
        state = model["attended"](args.context) + model["fixed_state"]
        print(
            f"\n{model['name']} ({model['format']}): a token reads {trunk / GB:.1f} GB of trunk "
            f"(attention {model['attention'] * model['trunk_bytes'] / GB:.1f}, shared "
            f"{model['shared'] * model['trunk_bytes'] / GB:.1f}, dense {model['dense'] * model['trunk_bytes'] / GB:.2f}, "
            f"head {model['head'] * model['trunk_bytes'] / GB:.2f}), {routed / GB:.1f} GB of routed experts and "
            f"{state / GB:.2f} GB of state at {args.context} tokens of context; experts in all "
            f"{experts / GB:.0f} GB; state {model['state_per_token'] / 1e3:.0f} KB a token of context"
        )
        if args.markdown:
            print(
                f"\n| machine | experts in VRAM / RAM | hit rate (prose / code) | decode tok/s "
                f"(prose / code) | GB read from disk a token | {args.prompt:,}-token prefill, f32 / ACT_BITS=8 |"
            )
            print("|---|---|---|---|---|---|")
        for machine in MACHINES:
            _, _, in_vram, in_ram = place(model, machine)
            (prose, code), measured_at = hit_rate(in_vram + in_ram)
            if "hits" in machine:
                (prose, code), measured_at = machine["hits"], None
            rates, disk = [], []
            for hits in (prose, code):
                seconds, _, miss = decode(model, machine, hits, args.context)
                rates.append(1 / seconds)
                disk.append(miss / GB)
            fills = [prefill(model, machine, args.prompt, a)[0] for a in ("f32", "ACT_BITS=8")]
            # The prefill runs on the host's cores; coli's GPU prefill is not measured at these widths.
            held = f"{in_vram:.0%} / {in_ram:.0%}" if "hits" not in machine else "(not published)"
            at = f" (study at {measured_at:g})" if measured_at and measured_at < 1 else ""
            if args.markdown:
                print(
                    f"| {machine['name']} | {held} | {prose:.0%} / {code:.0%}{at} | "
                    f"{rates[0]:.2f} / {rates[1]:.2f} | {disk[0]:.2f} / {disk[1]:.2f} | "
                    f"{fills[0] / 60:.1f} / {fills[1] / 60:.1f} min |"
                )
            else:
                print(
                    f"  {machine['name']}: experts {held} in VRAM/RAM, hits {prose:.0%}/{code:.0%}{at}: "
                    f"decode {rates[0]:.2f}/{rates[1]:.2f} tok/s, {disk[0]:.2f}/{disk[1]:.2f} GB from disk a token; "
                    f"prefill {args.prompt} tokens {fills[0] / 60:.1f} / {fills[1] / 60:.1f} min"
                )


if __name__ == "__main__":
    main()
