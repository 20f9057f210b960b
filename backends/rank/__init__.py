"""One rank's training loop: the interpreter, the executor and its streams, transfers, metrics, guards."""
