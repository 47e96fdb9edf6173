"""The spec layer: data the build and the runtime both read. `pipelines` (what each pipeline
compiles and reads; `vae_parts`, the VAE parts' modules), `shapes` (how an input dim follows
batch, size, frames and text length), `manifest` (the artifact's schema and environment),
`recipes` (quantization and the passes' data the runtime redoes), `private_apis` (every private
API of torch, diffusers and Ray, in one place). Imports nothing above it; `pipelines` and
`manifest` import no torch."""
