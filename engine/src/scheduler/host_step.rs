//! The part of a step the host computes: which tokens a step takes (decode tokens first, then
//! prompt chunks in the budget left), and the forward pass over their states gathered from the
//! pages (with the attached backend's ops), sampled and stored back.

use super::{Engine, Event, PROMPT_LOGPROB_CHUNK, StepError, handoff};
use crate::model::{ForwardError, Logits, Step};

impl Engine {
    /// What this step computes: (running index, token range, the logits it wants), decode
    /// tokens first, then prompt chunks in the token budget left.
    pub(super) fn plan_step(&self) -> Vec<(usize, std::ops::Range<usize>, Logits)> {
        let ps = self.config.page_size;
        let mut budget = self.config.max_batch_tokens.max(1);
        let device_chunk = self.device_prompt_chunk();
        let mut plan = Vec::new();
        for (i, r) in self.running.iter().enumerate() {
            if r.seq.len >= r.prompt_len && budget > 0 {
                plan.push((i, r.seq.len..r.seq.len + 1, Logits::Last));
                budget -= 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.seq.len < r.prompt_len && budget > 0 {
                let start = r.seq.len;
                let mut end = (start + budget).min(r.prompt_len);
                if r.prompt_logprobs.is_some() {
                    end = end.min(start + (PROMPT_LOGPROB_CHUNK / ps).max(1) * ps);
                }
                // Cut at a page boundary so the completed blocks can be cached.
                if end < r.prompt_len && (end / ps) * ps > start {
                    end = (end / ps) * ps;
                }
                // A device's prompt step takes at most its chunk of a sequence, ending on a page
                // boundary unless it ends the prompt (the blocks inside it are cached without
                // their slots: the state at its end is the only state it sends back).
                if device_chunk > 0 {
                    end = end.min(start + device_chunk);
                    if end < r.prompt_len && (end / ps) * ps > start {
                        end = (end / ps) * ps;
                    }
                }
                budget -= end - start;
                let logits = if r.prompt_logprobs.is_some() {
                    Logits::All
                } else if end == r.prompt_len {
                    Logits::Last
                } else {
                    Logits::None
                };
                plan.push((i, start..end, logits));
            }
        }
        plan
    }

    /// The forward pass on the host (with its attached backend) of the `plan`'s requests:
    /// their states gathered from the pages, computed, sampled and stored back. Returns the
    /// number of state parts emitted during the pass; the rest goes to `events`.
    pub(super) fn host_step(
        &mut self,
        plan: &[(usize, std::ops::Range<usize>, Logits)],
        emit: &mut (dyn FnMut(Event) + Send),
        events: &mut Vec<Event>,
        failed: &mut Vec<(usize, StepError)>,
    ) -> usize {
        let ps = self.config.page_size;
        let mut emitted = 0;
        let mut states = Vec::with_capacity(plan.len());
        for &(i, _, _) in plan {
            states.push(self.store.gather(&self.running[i].seq));
        }
        let mut ok_states = Vec::new();
        for ((i, range, logits), state) in plan.iter().zip(states) {
            match state {
                Ok(mut s) => {
                    // Record the compressors at every block boundary inside the chunk, so
                    // each completed block can enter the prefix cache.
                    for layer in &mut s.layers {
                        layer.boundary_every = if self.config.prefix_cache { ps } else { 0 };
                    }
                    ok_states.push((*i, range.clone(), *logits, s));
                }
                Err(e) => failed.push((*i, e.into())),
            }
        }
        // Prefill-only requests stream their state: (batch index, running index, range).
        let streamed: Vec<(usize, usize, std::ops::Range<usize>)> = ok_states
            .iter()
            .enumerate()
            .filter(|(_, (i, ..))| self.running[*i].handoff)
            .map(|(b, (i, range, ..))| (b, *i, range.clone()))
            .collect();
        for (_, i, range) in &streamed {
            match handoff::cached_part(&self.store, &self.running[*i], range.start) {
                Ok(Some(part)) => {
                    emitted += 1;
                    emit(part);
                }
                Ok(None) => {}
                Err(e) => failed.push((*i, e.into())),
            }
        }
        let result = {
            let mut batch: Vec<Step<'_>> = ok_states
                .iter_mut()
                .map(|(i, range, logits, state)| Step {
                    state,
                    tokens: &self.running[*i].tokens[range.clone()],
                    logits: *logits,
                })
                .collect();
            let (store, running) = (&mut self.store, &self.running);
            let mut after_layer = |l: usize, steps: &[Step<'_>]| {
                for (b, i, range) in &streamed {
                    match handoff::layer_part(store, &running[*i], steps[*b].state, l, range) {
                        Ok(Some(part)) => {
                            emitted += 1;
                            emit(part);
                        }
                        Ok(None) => {}
                        Err(e) => failed.push((*i, e.into())),
                    }
                }
            };
            self.model
                .forward_batch_observed(&mut batch, &mut after_layer)
        };
        match result {
            Ok(outputs) => {
                let mut ready = Vec::with_capacity(ok_states.len());
                for ((i, range, _, state), mut rows) in ok_states.into_iter().zip(outputs) {
                    if failed.iter().any(|(f, _)| *f == i) {
                        continue;
                    }
                    match self.take_prompt_logprobs(i, &range, &mut rows) {
                        Ok(next) => ready.push((i, state, next)),
                        Err(e) => failed.push((i, e)),
                    }
                }
                let rows: Vec<(usize, Option<&[f32]>)> = ready
                    .iter()
                    .map(|(i, _, next)| (*i, next.as_deref()))
                    .collect();
                let sampled = self.sample_all(&rows);
                for ((i, state, _), sampled) in ready.iter().zip(sampled) {
                    let stored = self.store_state(*i, state);
                    if let Err(e) = stored.and_then(|()| self.take_sampled(*i, sampled, events)) {
                        failed.push((*i, e));
                    }
                }
            }
            Err(e) => {
                let e: ForwardError = e;
                let e = StepError::Forward(e.to_string());
                failed.extend(ok_states.iter().map(|(i, ..)| (*i, e.clone())));
            }
        }
        emitted
    }
}
