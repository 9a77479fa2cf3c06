"""The seeded chaos soak (issue 19): the operator against a real kube-apiserver, a real
Ray head in address mode and real faults; see soak.py. Run it as
``python benchmarks/chaos --seed 1 --jobs 100 --minutes 20`` (``make chaos``)."""
