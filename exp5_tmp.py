import sys, torch
from tests.distributed import run_ranks

def body(rank, world, names, target):
    import retarget
    from tests import tp_models as tm
    out = {}
    for name in names:
        build, make_plan, kind = tm.MODELS[name]
        batch = tm.batch_for(kind, 4)
        ref = build(); loss_ref = tm.loss_of(ref, batch); loss_ref.backward()
        t = target.format(name=name.upper())
        compiled = retarget.compile_for(build(), t, example_inputs=tm.batch_for(kind, 2) if kind != "vector" else tm.batch_for(kind, 2)["x"])
        dp = world // compiled.program.plan.tp.size
        rows = 4 // dp; r = rank // compiled.program.plan.tp.size
        mine = {k: v[r*rows:(r+1)*rows] for k, v in batch.items()}
        for n, p in compiled.named_parameters():
            if n.endswith('c_attn.bias'):
                r = dict(ref.named_parameters())[n]
                print(rank, 'param full ok', torch.equal(p.full_tensor(), r.detach()), p.to_local().shape, flush=True)
        loss = tm.loss_of(compiled, mine); loss.backward()
        for n, p in compiled.named_parameters():
            if n.endswith('h.0.attn.c_attn.bias'):
                r = dict(ref.named_parameters())[n]
                full = r.detach(); loc = p.to_local().detach()
                idx = torch.tensor([int((full == v).nonzero()[0]) for v in loc])
                ok = torch.allclose(p.grad.to_local(), r.grad[idx], atol=1e-7)
                print(rank, 'grad local ok', ok, p.grad.placements, p.placements, flush=True)
        refs = dict(ref.named_parameters()); worst = 0.0
        scale = max(p.grad.abs().max().item() for p in ref.parameters())
        for n, p in compiled.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            e = ((g - refs[n].grad).abs().max() / max(refs[n].grad.abs().max().item(), 1e-3*scale)).item()
            worst = max(worst, e)
            if e > 1e-4 and rank == 0: print(name, n, e, getattr(p, 'placements', None), flush=True)
        lt = loss.detach().clone(); torch.distributed.all_reduce(lt); lt /= world
        out[name] = (abs(lt.item() - loss_ref.item()) / abs(loss_ref.item()), worst)
        if False: print(compiled.report, flush=True)
    return out

if __name__ == "__main__":
    world = int(sys.argv[1]); target = sys.argv[2]
    print(run_ranks(body, world, sys.argv[3:], target, timeout=600))
