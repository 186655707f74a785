"""Monitoring beside a local stack: a real Prometheus (Debian's package) scraping the services, and
prometheus-adapter (built from its Go module) serving custom.metrics.k8s.io for HorizontalPodAutoscalers."""
