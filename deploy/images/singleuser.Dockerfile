# The JupyterHub single-user image of the "OpenRL Lab" profile (deploy/jupyterhub/values.yaml): JupyterLab, this
# package, the "OpenRL (Python 3)" kernel and its server extension. Notebooks train through the control plane, so
# a CPU build of torch is enough here (the package needs torch). Build from the repository root:
#   docker build -f deploy/images/singleuser.Dockerfile -t openrl-lab-singleuser:0.1.0 \
#     --build-arg TORCH_INDEX_URL=<an index of CPU builds of torch> .
# JUPYTERHUB_SPEC must match the hub's major version (the z2jh chart's JupyterHub).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG NODE_IMAGE=node:20-bookworm-slim

# node (>= 20.19) builds the JupyterLab sidebar (labextension/) while the package installs
FROM ${NODE_IMAGE} AS node

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=""
ARG JUPYTERHUB_SPEC=jupyterhub==5.5.4
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# (DL3013: the version is pinned, in TORCH_SPEC)
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${TORCH_SPEC}"
COPY pyproject.toml README.md /src/
COPY openrl_lab /src/openrl_lab
COPY kernels /src/kernels
COPY jupyter-config /src/jupyter-config
COPY labextension /src/labextension
COPY --from=node /usr/local/bin/node /usr/local/bin/node
# the wheel build runs `jlpm build:prod` in labextension/ (jlpm from the build's JupyterLab, packages from the npm
# registry) and installs the sidebar under share/jupyter/labextensions/; the [lab] extra brings JupyterLab; jupyterhub provides jupyterhub-singleuser. (DL3013: a local path, and
# JUPYTERHUB_SPEC is pinned.)
# hadolint ignore=DL3013
RUN pip install "/src[lab]" "${JUPYTERHUB_SPEC}" && rm -rf /src \
    && openrl-lab install-kernelspec --sys-prefix

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/venv /opt/venv
# z2jh's defaults: uid 1000, gid 100 (singleuser.uid / fsGid), home /home/jovyan on the user's volume
RUN useradd --uid 1000 --gid 100 --create-home --home-dir /home/jovyan --shell /bin/bash jovyan
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SHELL=/bin/bash
USER 1000:100
WORKDIR /home/jovyan
EXPOSE 8888
CMD ["jupyterhub-singleuser"]
