"""What any engine runs to take an update: the requests it decodes, the plan of a receive, the programs that
cut a received bucket into the weights, checksums and delta headers, pieces put together, the values checked,
and where a session keeps its rollback copies. An engine offers its model through :class:`LoadableModel`
(:mod:`weightstream.receiver.model`); the reference engine and the vLLM plugin both sit on this layer."""
