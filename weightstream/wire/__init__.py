"""What crosses between processes: tensor handles, the IPC control channel and its frames, process groups."""
