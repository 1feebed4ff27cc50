"""`xlaserve bench`: measurements run side by side in one process, printed as one table.

    offline   a named workload (workload.py) through the engine, static batching on the same
              runner, and Hugging Face generate; throughput, latency, KV waste, compiles after
              warm-up; the batch-1 decode step against the bandwidth floor; per-device bytes
              (offline.py, one file per system)
    online    a named workload as Poisson arrivals at one or more rates against any
              OpenAI-compatible server, streamed: TTFT, TPOT, ITL, latency, throughput,
              goodput under SLOs; table, JSON, PNG (online.py, stream_client.py)
    startup   load and compile time of the model next to a shallow variant (startup.py)

cli.py registers them under the `xlaserve bench` command.
"""
