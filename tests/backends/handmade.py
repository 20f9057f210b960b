"""Small schedules built by hand for backend tests, following docs/schedule-contract.md.

Actions are emitted in one global order that runs sequentially, so every per-resource list is
consistent with it: forward packs in order, microbatch-major; backward packs in reverse; each
layer's GRAD_OUT and OPT_STEP after its last BWD. `swap="pack"` makes a pack's FWD / BWD wait for
all of the pack's LOADs, `swap="layer"` only for its own layer's.
"""

from __future__ import annotations

from tinypipe.ir.schedule import Action, Kind, Mem, Schedule, gpu_resource


def build(pack_layers: list[list[int]], pack_gpu: list[int], *, microbatches: int, iterations: int = 2,
          recompute: bool = True, swap: str = "layer", staleness: int = 0, act_home: str = "gpu",
          host_memory: str = "replicated", compute_dtype: str = "fp32", nbytes: int = 64) -> Schedule:
    acts: list[Action] = []
    num_gpus = max(pack_gpu) + 1
    num_layers = sum(len(p) for p in pack_layers)
    last = num_layers - 1
    gpu_of = {L: pack_gpu[p] for p, layers in enumerate(pack_layers) for L in layers}
    opt_id: dict[tuple[int, int], int] = {}
    evict_id: dict[int, int] = {}  # layer -> its latest EVICT: a new LOAD of it waits for that

    def add(kind: Kind, gpu: int | None, stream: str = "", *, layer: int | None = None, pack: int | None = None,
            mb: int | None = None, it: int = 0, peer: int | None = None, deps: tuple[int, ...] = (),
            allocs: tuple[Mem, ...] = (), frees: tuple[Mem, ...] = ()) -> int:
        res = "host.optim" if gpu is None else gpu_resource(gpu, stream)
        acts.append(Action(len(acts), kind, res, layer=layer, pack=pack, microbatch=mb, iteration=it, nbytes=nbytes,
                           peer=peer, deps=tuple(d for d in deps if d is not None and d >= 0),
                           allocs=allocs, frees=frees))
        return len(acts) - 1

    def mem(gpu: int | str, name: str) -> tuple[Mem, ...]:
        return (Mem(gpu if isinstance(gpu, str) else f"g{gpu}", name, nbytes),)

    for it in range(iterations):
        x_ready: dict[tuple[int, int], int] = {}  # (layer, mb) -> action making layer's input available
        dx_ready: dict[tuple[int, int], int] = {}
        bwd_done: dict[tuple[int, int], int] = {}
        prev_opt = it - 1 - staleness

        def load(L: int, p: int, g: int, it: int = it, prev_opt: int = prev_opt) -> int:
            dep = opt_id.get((L, prev_opt), -1)
            return add(Kind.LOAD, g, "h2d", layer=L, pack=p, it=it, deps=(dep, evict_id.get(L, -1)),
                       allocs=mem(g, f"w.L{L}"))

        def evict(L: int, p: int, g: int, deps: tuple[int, ...] = (), it: int = it) -> None:
            evict_id[L] = add(Kind.EVICT, g, "compute", layer=L, pack=p, it=it, deps=deps, frees=mem(g, f"w.L{L}"))

        # forward
        for p, layers in enumerate(pack_layers):
            g = pack_gpu[p]
            loads = {L: load(L, p, g) for L in layers}
            for m in range(microbatches):
                if layers[0] > 0 and gpu_of[layers[0] - 1] != g:
                    L = layers[0]
                    snd = x_ready[(L, m)]
                    add(Kind.SEND_F, gpu_of[L - 1], "send", layer=L, pack=p - 1, mb=m, it=it, peer=g, deps=(snd,),
                        frees=mem(gpu_of[L - 1], f"x.L{L}.m{m}"))
                    x_ready[(L, m)] = add(Kind.RECV_F, g, "recv", layer=L, pack=p, mb=m, it=it, peer=gpu_of[L - 1],
                                          allocs=mem(g, f"x.L{L}.m{m}"))
                for L in layers:
                    wait = tuple(loads.values()) if swap == "pack" else (loads[L],)
                    allocs = mem(g, f"x.L{L + 1}.m{m}") if L < last else ()
                    if not recompute:
                        allocs += mem(g, f"a.L{L}.m{m}")
                    f = add(Kind.FWD, g, "compute", layer=L, pack=p, mb=m, it=it,
                            deps=(*wait, x_ready.get((L, m), -1)), allocs=allocs)
                    if L < last:
                        x_ready[(L + 1, m)] = f
                    if act_home == "host" and L > 0:
                        x_ready[(L, m)] = add(Kind.OFFLOAD_ACT, g, "d2h", layer=L, pack=p, mb=m, it=it, deps=(f,),
                                              allocs=mem("host", f"act.L{L}.m{m}"), frees=mem(g, f"x.L{L}.m{m}"))
                    if swap == "layer" and m == microbatches - 1:
                        evict(L, p, g, (f,))
            if swap == "pack":
                for L in layers:
                    evict(L, p, g)
        # backward
        for p in reversed(range(len(pack_layers))):
            layers = pack_layers[p]
            g = pack_gpu[p]
            loads = {L: load(L, p, g) for L in reversed(layers)}
            for m in range(microbatches):
                nxt = layers[-1] + 1
                if nxt <= last and gpu_of[nxt] != g:
                    add(Kind.SEND_B, gpu_of[nxt], "send", layer=nxt, pack=p + 1, mb=m, it=it, peer=g,
                        deps=(dx_ready[(nxt, m)],), frees=mem(gpu_of[nxt], f"dx.L{nxt}.m{m}"))
                    dx_ready[(nxt, m)] = add(Kind.RECV_B, g, "recv", layer=nxt, pack=p, mb=m, it=it, peer=gpu_of[nxt],
                                             allocs=mem(g, f"dx.L{nxt}.m{m}"))
                for L in reversed(layers):
                    fetch = -1
                    if act_home == "host" and L > 0:
                        fetch = add(Kind.FETCH_ACT, g, "h2d", layer=L, pack=p, mb=m, it=it, deps=(x_ready[(L, m)],),
                                    allocs=mem(g, f"x.L{L}.m{m}"), frees=mem("host", f"act.L{L}.m{m}"))
                    wait = tuple(loads.values()) if swap == "pack" else (loads[L],)
                    allocs = mem(g, f"dx.L{L}.m{m}") if L > 0 else ()
                    if m == 0:
                        allocs += mem(g, f"gr.L{L}")
                    frees = mem(g, f"x.L{L}.m{m}") if L > 0 else ()
                    if L < last:
                        frees += mem(g, f"dx.L{L + 1}.m{m}")
                    if not recompute:
                        frees += mem(g, f"a.L{L}.m{m}")
                    b = add(Kind.BWD, g, "compute", layer=L, pack=p, mb=m, it=it,
                            deps=(*wait, dx_ready.get((L + 1, m), -1), fetch, x_ready.get((L, m), -1),
                                  bwd_done.get((L, m - 1), -1)),
                            allocs=allocs, frees=frees)
                    bwd_done[(L, m)] = b
                    if L > 0:
                        dx_ready[(L, m)] = b
                    if swap == "layer" and m == microbatches - 1:
                        evict(L, p, g, (b,))
            if swap == "pack":
                for L in layers:
                    evict(L, p, g)
            for L in reversed(layers):
                go = add(Kind.GRAD_OUT, g, "d2h", layer=L, pack=p, it=it, deps=(bwd_done[(L, microbatches - 1)],),
                         allocs=mem("host", f"gring.L{L}"), frees=mem(g, f"gr.L{L}"))
                opt_id[(L, it)] = add(Kind.OPT_STEP, None, layer=L, pack=p, it=it, deps=(go,),
                                      frees=mem("host", f"gring.L{L}"))
    return Schedule(actions=tuple(acts), num_gpus=num_gpus, num_layers=num_layers, iterations=iterations,
                    microbatches=microbatches, tokens_per_microbatch=1, recompute=recompute,
                    pack_layers=tuple(tuple(p) for p in pack_layers), pack_gpu=tuple(pack_gpu),
                    host_memory=host_memory, optimizer="async" if staleness else "sync", compute_dtype=compute_dtype)
