"""What any engine runs to take an update: the requests it decodes, the plan of a receive, the programs that
cut a received bucket into the weights, checksums and delta headers, pieces put together, the values checked,
and where a session keeps its rollback copies. An engine offers its model through :class:`LoadableModel`
(:mod:`weightstream.receiver.model`); the reference engine and the vLLM plugin both sit on this layer. An engine rank
that holds its weights itself takes every update through one :class:`~weightstream.receiver.receiver.Receiver`: its
session (:mod:`~weightstream.receiver.session`), the receives over weight-update groups
(:mod:`~weightstream.receiver.collective`) and the colocated ones (:mod:`~weightstream.receiver.ipc`)."""
