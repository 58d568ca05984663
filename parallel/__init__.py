"""megakern.parallel: tensor, sequence, pipeline, data, context and expert parallelism on torch.distributed.

Installed as ``megakern.parallel`` (the source folder is parallel/). Process groups and layouts are passed
explicitly; nothing here holds module-level state.
"""
