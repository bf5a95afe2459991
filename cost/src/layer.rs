//! What one layer costs: the time of its three passes and the memory it keeps. The leaf the
//! cost language ([`crate::cost`]) and the model shapes ([`crate::model`]) both build on.

use serde::Serialize;

/// Cost of the three passes of one layer.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct PassCost {
    /// Forward.
    pub f: f64,
    /// Input-gradient backward (`bwd_D`).
    pub b: f64,
    /// Weight-gradient backward (`bwd_W`).
    pub w: f64,
}

/// Memory of one layer: activations one microbatch keeps alive, and parameters + optimizer.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct LayerMemory {
    pub act: f64,
    pub param: f64,
    /// `K.act_w`: the part of `act` kept from the input-gradient backward (`bwd_D`) to the
    /// weight-gradient backward (`bwd_W`), the inputs of the layer's weight-gradient GEMMs;
    /// `None`: all of `act` (the default, [`LayerMemory::kept_for_w`]). Serialized only when
    /// given or derived, so older outputs stay byte-identical.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub act_w: Option<f64>,
}

impl LayerMemory {
    /// What `bwd_W` still needs after `bwd_D`: `act_w`, else all of `act`.
    pub fn kept_for_w(&self) -> f64 {
        self.act_w.unwrap_or(self.act)
    }
}

impl PassCost {
    pub const ZERO: PassCost = PassCost {
        f: 0.0,
        b: 0.0,
        w: 0.0,
    };
}

/// A part whose whole time at `seq` tokens is `total`, `attn` of it attention, for a
/// microbatch of scale `(lin, quad)`: `lin (total - attn) + quad attn`, and `total` itself
/// at `(1, 1)` (bit for bit, whatever the rounding of the split). Never below 0.
#[inline]
pub fn scaled(total: f64, attn: f64, lin: f64, quad: f64) -> f64 {
    if lin == 1.0 && quad == 1.0 {
        total
    } else {
        (lin * (total - attn) + quad * attn).max(0.0)
    }
}
