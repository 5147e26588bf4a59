import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from _parallel_util import ep_mesh, spawn
from moetrain.config import Config
from moetrain.parallel.launch import ParallelHooks
from moetrain.train.trainer import Trainer

root = Path(sys.argv[1])

def worker(rank, world, out_dir, cfg_dict):
    cfg = Config.from_dict(cfg_dict)
    hooks = ParallelHooks(ep_mesh(world))
    r = Trainer(cfg, root / "ep2", hooks=hooks, progress=False, log=print if rank == 0 else (lambda m: None)).run(stop_at_step=3)
    return r.losses

d = json.loads((root / "single" / "config.json").read_text())
d["parallel"]["ep"] = 2
d["data"]["cache_dir"] = str(root / "cache")
print(spawn(worker, 2, root / "spawn", d))
