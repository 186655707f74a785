"""Local-stack and test tooling that production never imports.

`devstack.embedded` runs throwaway PostgreSQL and NATS servers, `devstack.cluster` a real Kubernetes control
plane (built from source and cached) with simulated nodes and a kubelet stand-in, and `devstack.stack` puts
the whole product together on them (`gpushare up`, the end-to-end and reliability tiers, the benchmarks).
"""
