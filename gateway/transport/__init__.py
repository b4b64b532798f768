"""Upstream connections: the llhttp client and its pools, what a request carries upstream
(hop-by-hop hygiene, forwarding headers), the pipeline's last handler, and warm-up."""
