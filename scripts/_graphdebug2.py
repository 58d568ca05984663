# one-off (not committed): where does the accum=1 graph step fail?
import sys, tempfile, torch
from megakern.config import load_config
from megakern.train import Trainer, StepGraph
tmp = tempfile.mkdtemp()
QUIET = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0"]
TINY = QUIET + ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.max_seqlen=64",
                "train.micro_batch_size=8", "optim.lr=3e-3", "schedule.warmup_steps=10", "eval.batches=4"]
ov = TINY + ["train.device=cuda", "train.precision=bf16", "train.steps=5", "train.global_batch_size=8", "eval.every=0",
             "checkpoint.every=0", "checkpoint.final=false", "train.cuda_graph=true", "train.cuda_graph_warmup=2",
             f"log.run_dir={tmp}/run", f"data.cache_dir={tmp}/data"] + sys.argv[1:]
t = Trainer(load_config(None, ov), stream=open(f"{tmp}/console", "w"))
ms = t.master_step
cap = StepGraph._capture
def capture(self):
    cap(self)
    torch.cuda.synchronize()
    if ms is not None:
        for k, v in ms._tables.items():
            if isinstance(k[1], tuple) and isinstance(k[1][0], tuple):
                got = v.cpu().reshape(-1, 8)
                want = torch.tensor(k[1])
                print("graph table", k[0], "ok" if torch.equal(got, want) else "DIFFERENT", flush=True)
        grads = [p.grad for p in ms.models.values()]
        print("grads after capture", sum(g is None for g in grads), "None of", len(grads), flush=True)
StepGraph._capture = capture
rep = torch.cuda.CUDAGraph.replay
def replay(self):
    rep(self)
    torch.cuda.synchronize()
    print("replay ok", flush=True)
torch.cuda.CUDAGraph.replay = replay
try:
    r = t.run()
    print("losses", r.losses)
except Exception as e:
    print("ERROR", type(e).__name__, str(e)[:200])
