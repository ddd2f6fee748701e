"""Ratchet's kernel: what the services (proxy, judge, learner, console) share, and nothing they
do not. The services meet only here; the kernel imports none of them, nor the apps above them
(``cli``, ``embedded``, ``tasks``).

- Contracts: ``settings`` (the configuration's models), ``records`` (one type per Kafka topic,
  free of client libraries) and ``bill`` (what learning costs, which the records carry).
- Transport and storage: ``bus`` (Kafka topics and consumers), ``store`` (the adapter store),
  ``durable`` (fsync), ``secrets`` (the server secret and what is derived from it).
- State the services share in Redis: ``registry`` (routes and history), ``lifecycle`` (canary,
  promote, reject, roll back, pause), ``versions``, ``lease``, ``progress``, ``carry``,
  ``canary_state``, ``gate_pairs``, ``verdict``, ``rounds`` and ``spend`` (the daily judge
  budget).
- Statistics and choices: ``sequential`` (the gate's and canary's always-valid test),
  ``evaluation``, ``answer_length``, ``fleet`` (which vLLM replica answers).
- ``rewards``: verifiers, the RULER judge, reward models, ratings and their agreement.
"""

__version__ = "0.1.0"
