"""Prefill and decode on separate workers (the seed's two worker boxes): the KV handoff over
gRPC (transfer.py), the front end's engine that pairs a prefill worker with a decode worker
(engine.py), and the spawning of local workers (workers.py)."""
