# syntax=docker/dockerfile:1
# An image that only holds trained artifacts, for Kubernetes (deploy/kubernetes/deployment.yaml): its init container
# copies /artifacts into the pod's own volume, where the API reads them. A new model version is a new tag of this
# image, rolled out (and rolled back) like code.
# Build from the repository root with ./artifacts holding <model>/<version>/manifest.json:
#   docker build -f docker/artifacts.Dockerfile -t registry.example.com/nextstep-artifacts:2026-01-15 .
FROM busybox:1.36.1

# The files must be readable by uid 10001 (the init container's user): `nextstep train` writes them 0644.
COPY artifacts /artifacts

USER 10001:10001
CMD ["ls", "-R", "/artifacts"]
