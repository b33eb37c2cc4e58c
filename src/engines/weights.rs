//! The one weight loader every engine builds from: names resolved under a prefix, shapes
//! checked against what `config.json` implies, float tensors converted to the width asked
//! for, and every byte kept resident counted as it is loaded.
//!
//! It owns the rules the engines share (which width dense matrices, embeddings and routers
//! take; when the LM head is the embedding); it reads no `config.json` key and decides no
//! model's layout. Routed experts are not loaded here: their views go to the expert store.

use std::cell::Cell;
use std::rc::Rc;

use anyhow::{bail, Result};

use crate::quant::{format, load_vector, Matrix, Width};
use crate::snapshot::{Snapshot, TensorView};

/// The weights of a snapshot under one prefix (`model.layers.3.self_attn`), at the dense
/// width of a run. [`Weights::at`] narrows the prefix; every narrowed loader adds to the
/// same resident count.
pub struct Weights<'a> {
    snapshot: &'a Snapshot,
    prefix: String,
    dense: Width,
    resident: Rc<Cell<usize>>,
}

impl<'a> Weights<'a> {
    /// The whole snapshot, dense matrices at `dense`.
    pub fn new(snapshot: &'a Snapshot, dense: Width) -> Weights<'a> {
        Weights {
            snapshot,
            prefix: String::new(),
            dense,
            resident: Rc::new(Cell::new(0)),
        }
    }

    /// The weights under `prefix` (joined to this one's with a dot).
    pub fn at(&self, prefix: &str) -> Weights<'a> {
        Weights {
            snapshot: self.snapshot,
            prefix: self.name(prefix),
            dense: self.dense,
            resident: Rc::clone(&self.resident),
        }
    }

    pub fn snapshot(&self) -> &'a Snapshot {
        self.snapshot
    }

    /// The full tensor name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        match (self.prefix.is_empty(), name.is_empty()) {
            (true, _) => name.to_string(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}.{name}", self.prefix),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.snapshot.contains(&self.name(name))
    }

    /// The tensor `name`, which must hold a `shape` weight (a pre-quantised one by its byte
    /// counts), with `shape` as its shape; not loaded, not counted (routed experts, slices).
    pub fn view(&self, name: &str, shape: &[usize]) -> Result<TensorView> {
        format::shaped(self.snapshot.tensor(&self.name(name))?, shape)
    }

    /// A dense matrix at the run's dense width (`DBITS`).
    pub fn matrix(&self, name: &str, shape: [usize; 2]) -> Result<Matrix> {
        self.matrix_at(name, shape, self.dense)
    }

    /// A matrix kept in f32 whatever the run's width: a router, or a small product that
    /// steers every row (the engines' `KEPT_F32`).
    pub fn matrix_f32(&self, name: &str, shape: [usize; 2]) -> Result<Matrix> {
        self.matrix_at(name, shape, Width::F32)
    }

    /// The token embedding: f32 unless dense weights go below 8 bits.
    pub fn embedding(&self, name: &str, shape: [usize; 2]) -> Result<Matrix> {
        self.matrix_at(name, shape, self.dense.for_embeddings())
    }

    /// The LM head `head` at the embedding's width; where the checkpoint has no `head` and
    /// the config ties the head to the embedding (`tie_word_embeddings`), `embedding`.
    pub fn lm_head(
        &self,
        head: &str,
        embedding: &str,
        tied: bool,
        shape: [usize; 2],
    ) -> Result<Matrix> {
        let name = if !self.contains(head) && tied {
            embedding
        } else {
            head
        };
        self.embedding(name, shape)
    }

    /// A slice of a loaded matrix's stacked tensor (one shared expert of `[n, rows, cols]`)
    /// at the dense width.
    pub fn dense_from(&self, view: &TensorView) -> Result<Matrix> {
        self.count(Matrix::load(view, self.dense)?)
    }

    fn matrix_at(&self, name: &str, shape: [usize; 2], width: Width) -> Result<Matrix> {
        self.count(Matrix::load(&self.view(name, &shape)?, width)?)
    }

    fn count(&self, matrix: Matrix) -> Result<Matrix> {
        self.add(matrix.size_bytes());
        Ok(matrix)
    }

    fn add(&self, bytes: usize) {
        self.resident.set(self.resident.get() + bytes);
    }

    /// A float vector of `len` (a norm, a bias), in f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let values = load_vector(&self.snapshot.tensor(&self.name(name))?, len)?;
        self.add(4 * values.len());
        Ok(values)
    }

    /// A float tensor of any `shape`, flattened into f32 (a convolution's taps, a bank of
    /// position profiles, a `[1, D]` projection read as a vector).
    pub fn flat(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let mut view = self.view(name, shape)?;
        let len = shape.iter().product();
        view.shape = vec![len];
        let values = load_vector(&view, len)?;
        self.add(4 * values.len());
        Ok(values)
    }

    /// A float tensor of whatever shape the checkpoint gives it, flattened into f32 (a
    /// per-head parameter some releases pad).
    pub fn flat_any(&self, name: &str) -> Result<Vec<f32>> {
        let mut view = self.snapshot.tensor(&self.name(name))?;
        let len = view.numel();
        view.shape = vec![len];
        let values = load_vector(&view, len)?;
        self.add(4 * values.len());
        Ok(values)
    }

    /// A one-element float tensor (a learned scale), of shape `[]` or `[1]`.
    pub fn scalar(&self, name: &str) -> Result<f32> {
        let mut view = self.snapshot.tensor(&self.name(name))?;
        if view.numel() != 1 {
            bail!(
                "{}: tensor {} has shape {:?}, expected a scalar",
                view.file.display(),
                view.name,
                view.shape
            );
        }
        view.shape = vec![1];
        let value = load_vector(&view, 1)?[0];
        self.add(4);
        Ok(value)
    }

    /// Bytes of every matrix, vector and scalar loaded through this loader or any loader
    /// narrowed from the same one: the resident trunk the expert store is sized beside.
    pub fn resident_bytes(&self) -> usize {
        self.resident.get()
    }
}
