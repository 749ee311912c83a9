"""``disagg bench``: a cluster measured against the design documents' success metrics (seed 004), beside peers.

- ``workloads``: what is sent (the grader's own requests, chat, long prompts, a JSONL file);
- ``endpoints``: where (the cluster through the client or its gateway; OpenAI- or Ollama-API peers);
- ``load``: how (concurrency, Poisson rate, sweep; phases alternating between the cluster and its peers);
- ``measure``: per-request TTFT, TPOT, ITL, E2EL under ``vllm bench serve``'s names, and the handoff's parts;
- ``machines``: energy, cost and utilization of the cluster's machines while it runs;
- ``table``: seed 004's success metrics, each met, not met or not measured (with the reason);
- ``report``/``charts``: bench.json, bench.md and the PNG charts; ``run``: all of it in order.

The soak (``benchmarks/soak.py``) runs the same load for long under faults: ``soak`` (its cluster, load and
resource samples), ``faults`` (each fault and its window), ``netns`` (a prefill server behind a link of its
own, for the link faults), ``soak_figures`` (lost, duplicated, error rates, failover, growth, its chart).
"""
