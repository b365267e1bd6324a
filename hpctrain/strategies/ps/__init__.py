"""Parameter-server training over mpi4py: server ranks own parameter shards and the
optimizer, worker ranks compute gradients (the BytePS / ps-lite family).

Modules: `sharding` (which server owns which slice), `optim` (torch's update rules in
numpy), `protocol` (tags, headers, polling without busy-waiting), `server`, `worker`,
`runner` (the `strategy: parameter_server` entry point) and `cli` (`hpctrain ps`).
"""
