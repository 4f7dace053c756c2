"""The multi-host fault test's helpers: test hosts made of network namespaces, the services they reach on the host,
the export workers, the fault schedule and the survey of what readers see.

Only :mod:`.worker` imports ``export_ledger``: every call into the library (the worker's export loop, and the host's
reconciliation passes and ledger reads) is there, so that a change of the library's API is ported in one file. The
other modules are plain Python and the standard library (and boto3 for the survey's direct look at the bucket).

Layout:

* :mod:`.netns`: three namespaces, each joined to the host by a veth pair on a /30 of its own; cut and restore a link.
* :mod:`.services`: moto's S3 server bound to each host-side address, and an asyncio TCP forwarder from each
  host-side address to PostgreSQL on 127.0.0.1:5432 (so the server's loopback trust applies unchanged).
* :mod:`.worker`: the export worker (``python -m tests.multihost.worker CONFIG``) and the host's ledger calls.
* :mod:`.faults`: the seeded fault schedule (link cuts, pauses longer than a lease) and its executor.
* :mod:`.cluster`: one run's whole setup (hosts, servers, schema, bucket, workers) and its teardown, and the host's
  reconciliation loop.
* :mod:`.survey`: the bucket as readers see it (the 0.4 layout and protocol version 2's pointer and places), and
  the checks against the ledger and the workers' journals.
"""
