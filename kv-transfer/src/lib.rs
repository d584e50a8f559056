//! Moving request state between processes (UCX, NCCL, plain TCP) and the layout handshake.
//! Transports arrive with the "PD data path" work.
