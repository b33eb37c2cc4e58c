//! An expert group's routing as every device lays it out, and the checks each makes before
//! it stages one: the front door of [`Device::expert_group`](super::Device::expert_group),
//! as [`rms_norm_rows`](super::rms_norm_rows) is RMSNorm's. What a device does with the
//! layout (its buffers, jobs and dispatches) stays in the device.

use super::{DeviceError, ExpertGroup, GroupExpert};

/// The routed (row, expert) pairs of a group as slots: slot `s` is the `s`-th pair in
/// expert order, skipping the experts with no rows; each output row sums its slots in
/// expert order. The numbers are `i32`, as the device kernels index.
#[derive(Debug)]
pub struct GroupRouting<'g> {
    /// The experts with rows, in the group's order, each with its first slot: its rows are
    /// slots `first..first + rows.len()`.
    pub experts: Vec<(&'g GroupExpert<'g>, usize)>,
    /// The input row of each slot.
    pub slot_rows: Vec<i32>,
    /// Output row `r`'s entries are `row_start[r]..row_start[r + 1]` (`rows + 1` values).
    pub row_start: Vec<i32>,
    /// Each entry's slot.
    pub entry_slot: Vec<i32>,
    /// Each entry's gate weight.
    pub entry_weight: Vec<f32>,
}

impl<'g> GroupRouting<'g> {
    /// The routing of `group` whose output is `out_len` floats; `None` when no expert has
    /// a row (the output is all zeros). Refuses a group whose input or output is not
    /// `rows x width`, a routed row past `rows`, or more slots than an `i32` counts.
    pub fn new(
        group: &'g ExpertGroup<'g>,
        out_len: usize,
    ) -> Result<Option<GroupRouting<'g>>, DeviceError> {
        let (rows, width) = (group.rows, group.width);
        if group.input.len() != rows * width || out_len != rows * width {
            return Err(DeviceError::Unsupported(format!(
                "an expert group of {rows} rows of width {width} with {} inputs and {out_len} outputs",
                group.input.len()
            )));
        }
        let mut experts = Vec::new();
        let mut slot_rows = Vec::new();
        let mut row_start = vec![0i32; rows + 1];
        for expert in group.experts.iter().filter(|e| !e.rows.is_empty()) {
            experts.push((expert, slot_rows.len()));
            for &(row, _) in expert.rows {
                if row >= rows {
                    return Err(DeviceError::Unsupported(format!(
                        "an expert routed row {row} of a {rows}-row group"
                    )));
                }
                slot_rows.push(row as i32);
                row_start[row + 1] += 1;
            }
        }
        let slots = slot_rows.len();
        if slots == 0 {
            return Ok(None);
        }
        if slots > i32::MAX as usize {
            return Err(DeviceError::Unsupported(format!(
                "{slots} routed rows in one group"
            )));
        }
        for r in 0..rows {
            row_start[r + 1] += row_start[r];
        }
        let mut next: Vec<usize> = row_start[..rows].iter().map(|&s| s as usize).collect();
        let mut entry_slot = vec![0i32; slots];
        let mut entry_weight = vec![0f32; slots];
        let entries = experts.iter().flat_map(|(e, _)| e.rows.iter());
        for (slot, &(row, weight)) in entries.enumerate() {
            entry_slot[next[row]] = slot as i32;
            entry_weight[next[row]] = weight;
            next[row] += 1;
        }
        Ok(Some(GroupRouting {
            experts,
            slot_rows,
            row_start,
            entry_slot,
            entry_weight,
        }))
    }

    /// Routed (row, expert) pairs.
    pub fn slots(&self) -> usize {
        self.slot_rows.len()
    }
}

/// Experts `0..routes.len()` with weights `3e`, `3e + 1`, `3e + 2` and those rows, for the
/// layout tests here and in the devices' plans.
#[cfg(test)]
pub(crate) fn numbered_experts<'a>(routes: &[&'a [(usize, f32)]]) -> Vec<GroupExpert<'a>> {
    routes
        .iter()
        .enumerate()
        .map(|(e, rows)| GroupExpert {
            gate: 3 * e as u64,
            up: 3 * e as u64 + 1,
            down: 3 * e as u64 + 2,
            rows,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::Activation;

    #[test]
    fn slots_in_expert_order_and_each_row_sums_in_expert_order() {
        let rows_of = [&[(2, 0.5), (0, 0.25)][..], &[], &[(0, 2.0), (1, 1.0)]];
        let experts = numbered_experts(&rows_of);
        let input = vec![0f32; 4 * 8];
        let group = ExpertGroup {
            experts: &experts,
            input: &input,
            rows: 4,
            width: 8,
            activation: Activation::SwiGlu,
        };
        let routing = GroupRouting::new(&group, 32).unwrap().expect("routed rows");
        let firsts: Vec<usize> = routing.experts.iter().map(|&(_, first)| first).collect();
        assert_eq!(firsts, [0, 2]);
        assert_eq!(routing.slot_rows, [2, 0, 0, 1]);
        assert_eq!(routing.row_start, [0, 2, 3, 4, 4]);
        assert_eq!(routing.entry_slot, [1, 2, 3, 0]);
        assert_eq!(routing.entry_weight, [0.25, 2.0, 1.0, 0.5]);

        assert!(GroupRouting::new(&group, 31).is_err());
        let stray = [GroupExpert {
            gate: 0,
            up: 1,
            down: 2,
            rows: &[(4, 1.0)],
        }];
        let bad = ExpertGroup {
            experts: &stray,
            ..group
        };
        assert!(GroupRouting::new(&bad, 32).is_err());
        let idle = ExpertGroup {
            experts: &experts[1..2],
            ..group
        };
        assert!(GroupRouting::new(&idle, 32).unwrap().is_none());
    }
}
