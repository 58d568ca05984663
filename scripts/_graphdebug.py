# one-off (not committed): the tiny model with a CUDA-graph step and one micro-batch, bf16 weights
import sys, tempfile, torch
from megakern.config import load_config
from megakern.train import Trainer
tmp = tempfile.mkdtemp()
QUIET = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0"]
TINY = QUIET + ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.max_seqlen=64",
                "train.micro_batch_size=8", "optim.lr=3e-3", "schedule.warmup_steps=10", "eval.batches=4"]
ov = TINY + ["train.device=cuda", "train.precision=bf16", "train.steps=6", "train.global_batch_size=8", "eval.every=0",
             "checkpoint.every=0", "checkpoint.final=false", "train.cuda_graph=true", "train.cuda_graph_warmup=2",
             f"log.run_dir={tmp}/run", f"data.cache_dir={tmp}/data"] + sys.argv[1:]
t = Trainer(load_config(None, ov), stream=sys.stdout)
ms = t.master_step
orig = ms._tables_for
def spy(key, members):
    out = orig(key, members)
    print("tables_for", key, "capturing", torch.cuda.is_current_stream_capturing(), "programs", out[2],
          "pending", len(ms._pending), "ngrads", len(members), "contig", all(g.is_contiguous() for _, g, _, _ in members))
    return out
ms._tables_for = spy
r = t.run()
torch.cuda.synchronize()
print("losses", r.losses)
