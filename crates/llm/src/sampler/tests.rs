//! The sampler against hand-made logits: greedy, temperature and nucleus sampling, the
//! penalties, the n-gram block and the context biases, log-probabilities.
use candle_core::Device;

use super::*;

fn draw(sampling: Sampling, logits: &[f32], n: usize) -> Vec<u32> {
    let logits = Logits::Device(Tensor::new(logits, &Device::Cpu).unwrap());
    let mut s = Sampler::new(&sampling);
    (0..n).map(|_| s.sample(&logits).unwrap()).collect()
}

fn sampling(temperature: f64, top_p: Option<f64>, seed: u64) -> Sampling {
    Sampling {
        temperature,
        top_p,
        seed,
        ..Sampling::default()
    }
}

/// The greedy picks after each token of `history` was generated.
fn greedy_after(sampling: Sampling, logits: &[f32], history: &[u32]) -> u32 {
    let mut s = Sampler::new(&sampling);
    if let Some(p) = &mut s.penalties {
        history.iter().for_each(|&t| p.accept(t));
    }
    s.sample(&Logits::Host(logits.to_vec())).unwrap()
}

#[test]
fn presence_and_frequency_penalties_subtract_from_seen_tokens() {
    let logits = [1.0, 0.0, 3.0, -2.0];
    let s = Sampling {
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Sampling::default()
    };
    let mut p = Penalties::new(&s).unwrap();
    [2, 2, 3].iter().for_each(|&t| p.accept(t));
    let mut adjusted = logits;
    p.apply(&mut adjusted);
    // Token 2: seen twice, 3 - 0.5 - 2 * 0.25; token 3: once; 0 and 1 untouched.
    assert_eq!(adjusted, [1.0, 0.0, 2.0, -2.75]);
    // Strong enough, the penalty moves greedy off the repeated token; negative, it favours it.
    let strong = Sampling {
        frequency_penalty: 1.5,
        ..Sampling::default()
    };
    assert_eq!(greedy_after(strong, &logits, &[2]), 2);
    assert_eq!(greedy_after(strong, &logits, &[2, 2]), 0);
    let negative = Sampling {
        presence_penalty: -2.0,
        ..Sampling::default()
    };
    assert_eq!(greedy_after(negative, &[3.0, 1.5], &[1]), 1);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let s = Sampling {
        repetition_penalty: 2.0,
        ..Sampling::default()
    };
    let mut p = Penalties::new(&s).unwrap();
    [0, 1, 1].iter().for_each(|&t| p.accept(t));
    let mut adjusted = [4.0, -1.0, 3.0];
    p.apply(&mut adjusted);
    // Once per seen token whatever the count (HF's semantics).
    assert_eq!(adjusted, [2.0, -2.0, 3.0]);
    assert_eq!(greedy_after(s, &[4.0, -1.0, 3.0], &[0]), 2);
    // Neutral settings add no work at all.
    assert!(Penalties::new(&Sampling::default()).is_none());
    // A prompt token counts only when asked.
    let logits = Logits::Host(vec![4.0, -1.0, 3.0]);
    assert_eq!(Sampler::new(&s).seeing(&[0]).sample(&logits).unwrap(), 2);
    let plain = Sampler::new(&Sampling::default()).seeing(&[0]);
    assert!(plain.penalties.is_none());
}

#[test]
fn the_context_bias_favours_the_contexts_tokens_only() {
    let logits = Logits::Host(vec![3.0, 2.0, 1.5, 0.0]);
    let s = Sampling {
        context_bias: 1.0,
        ..Sampling::default()
    };
    // Token 2 is in the context: 1.5 + 1.0 beats 2.0 but not 3.0; with 2.0 it wins.
    let pick = |s: &Sampling, context: &[u32]| {
        Sampler::for_request(s, &[], context, &[])
            .pick(&logits, Some(1))
            .unwrap()
    };
    assert_eq!(pick(&s, &[2, 2]).token, 0);
    let strong = Sampling {
        context_bias: 2.0,
        ..s
    };
    let p = pick(&strong, &[2, 2]);
    assert_eq!(p.token, 2);
    // The reported log-probabilities are the model's own, before the bias.
    let (lp, top) = p.logprobs.unwrap();
    assert_eq!(top[0].0, 0);
    assert!(lp < top[0].1);
    // No context, or no bias: the model's own pick.
    assert_eq!(pick(&strong, &[]).token, 0);
    assert_eq!(pick(&Sampling::default(), &[2]).token, 0);
}

#[test]
fn the_copy_bias_favours_what_follows_the_longest_match_in_the_context() {
    let s = Sampling {
        copy_bias: 2.0,
        ..Sampling::default()
    };
    // The context spells "5 1 2" and "7 1 3": after "7 1" the longer match says 3.
    let context = [5, 1, 2, 9, 7, 1, 3];
    let logits = Logits::Host(vec![0.0, 0.0, 1.0, 0.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0]);
    let mut sampler = Sampler::for_request(&s, &[4, 4], &context, &[]);
    let feed = |sampler: &mut Sampler, token: u32| {
        sampler.penalties.as_mut().unwrap().accept(token);
    };
    // Nothing generated yet: no bias, the model's own pick.
    assert_eq!(sampler.sample(&logits).unwrap(), 4);
    sampler = Sampler::for_request(&s, &[4, 4], &context, &[]);
    feed(&mut sampler, 7);
    feed(&mut sampler, 1);
    assert_eq!(sampler.sample(&logits).unwrap(), 3);
    // After a lone "1" both continuations match one token long: 2 wins on its logit.
    let mut sampler = Sampler::for_request(&s, &[], &context, &[]);
    feed(&mut sampler, 1);
    assert_eq!(sampler.sample(&logits).unwrap(), 2);
    // A token the context does not hold: the model's own pick.
    let mut sampler = Sampler::for_request(&s, &[], &context, &[]);
    feed(&mut sampler, 8);
    assert_eq!(sampler.sample(&logits).unwrap(), 4);
    // The prompt, counted for the penalties, is not part of the answer being matched.
    let counted = Sampling {
        penalize_prompt: true,
        ..s
    };
    let mut sampler = Sampler::for_request(&counted, &[7, 1], &context, &[]);
    assert_eq!(sampler.sample(&logits).unwrap(), 4);
}

#[test]
fn no_repeat_ngram_blocks_the_token_completing_a_seen_ngram() {
    let s = Sampling {
        no_repeat_ngram: 3,
        ..Sampling::default()
    };
    let mut p = Penalties::new(&s).unwrap();
    // 5 6 7 ... 5 6: a 7 would repeat "5 6 7".
    [5, 6, 7, 1, 5, 6].iter().for_each(|&t| p.accept(t));
    let mut blocked = Vec::new();
    p.for_each_blocked(|t| blocked.push(t));
    assert_eq!(blocked, [7]);
    let mut logits = vec![0.0; 8];
    logits[7] = 5.0;
    logits[4] = 1.0;
    assert_eq!(greedy_after(s, &logits, &[5, 6, 7, 1, 5, 6]), 4);
    // Not after "6 5": nothing to complete.
    assert_eq!(greedy_after(s, &logits, &[5, 6, 7, 6, 5]), 7);
    let unigram = Sampling {
        no_repeat_ngram: 1,
        ..Sampling::default()
    };
    assert_eq!(greedy_after(unigram, &[3.0, 2.0, 1.0], &[0, 1]), 2);
}

#[test]
fn an_ngram_the_context_repeats_may_be_repeated_as_often_as_it_does() {
    let s = Sampling {
        no_repeat_ngram: 3,
        ..Sampling::default()
    };
    let mut host = vec![0.0; 8];
    host[7] = 5.0;
    host[4] = 1.0;
    let logits = Logits::Host(host);
    let answer = [5, 6, 7, 1, 5, 6];
    let pick = |context: &[u32]| {
        let mut sampler = Sampler::for_request(&s, &[], context, &[]);
        answer
            .iter()
            .for_each(|&t| sampler.penalties.as_mut().unwrap().accept(t));
        sampler.sample(&logits).unwrap()
    };
    // "5 6 7" twice in the context: the answer may say it a second time, not a third.
    assert_eq!(pick(&[5, 6, 7, 2, 5, 6, 7]), 7);
    assert_eq!(pick(&[5, 6, 7, 2]), 4);
    assert_eq!(pick(&[]), 4);
    let thrice = [5, 6, 7, 1, 5, 6, 7, 1, 5, 6];
    let mut sampler = Sampler::for_request(&s, &[], &[5, 6, 7, 2, 5, 6, 7], &[]);
    thrice
        .iter()
        .for_each(|&t| sampler.penalties.as_mut().unwrap().accept(t));
    assert_eq!(sampler.sample(&logits).unwrap(), 4);
}

#[test]
fn logprobs_are_the_raw_log_softmax_with_the_top_sorted() {
    let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
    let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
    let (chosen, top) = logprobs(&logits, 2, 3);
    assert!((chosen as f64 - (2.0 - z.ln())).abs() < 1e-6);
    assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 2]);
    assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
    let total: f64 = (0..5)
        .map(|i| (logprobs(&logits, i, 0).0 as f64).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    // Greedy's pick carries the largest log-probability, taken before any penalty.
    let s = Sampling {
        frequency_penalty: 1.0,
        ..Sampling::default()
    };
    let mut sampler = Sampler::new(&s);
    let pick = sampler
        .pick(&Logits::Host(logits.to_vec()), Some(2))
        .unwrap();
    assert_eq!(pick.token, 1);
    let (lp, top) = pick.logprobs.unwrap();
    assert_eq!(lp, top[0].1);
    assert!(lp <= 0.0);
    // Token 1 is now penalised: greedy takes 3; its log-probability is still the raw one.
    let pick = sampler
        .pick(&Logits::Host(logits.to_vec()), Some(2))
        .unwrap();
    assert_eq!(pick.token, 3);
    assert_eq!(pick.logprobs.unwrap().0, lp);
}

#[test]
fn sampler_greedy_takes_the_argmax() {
    let logits = [0.1, 2.0, -1.0, 1.9];
    assert_eq!(draw(sampling(0.0, None, 1), &logits, 3), [1, 1, 1]);
    assert_eq!(draw(sampling(f64::NAN, Some(0.5), 1), &logits, 1), [1]);
}

#[test]
fn sampler_never_picks_a_banned_token() {
    let logits = Logits::Device(Tensor::new(&[0.1f32, 2.0, -1.0, 1.9], &Device::Cpu).unwrap());
    let mut greedy = Sampler::new(&sampling(0.0, None, 1)).banning(&[1]);
    assert_eq!(greedy.sample(&logits).unwrap(), 3);
    let mut sampled = Sampler::new(&sampling(1.0, Some(0.9), 5)).banning(&[1, 3]);
    for _ in 0..200 {
        assert!(![1, 3].contains(&sampled.sample(&logits).unwrap()));
    }
}

#[test]
fn sampler_follows_the_softmax() {
    // p = [0.25, 0.75]
    let logits = [0.0, 3f32.ln()];
    let picks = draw(sampling(1.0, None, 42), &logits, 4000);
    let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
    assert!((ones - 0.75).abs() < 0.03, "{ones}");
    // Temperature 2 flattens it to softmax([0, ln 3 / 2]) = [0.366, 0.634].
    let picks = draw(sampling(2.0, None, 42), &logits, 4000);
    let ones = picks.iter().filter(|&&i| i == 1).count() as f64 / 4000.0;
    assert!((ones - 0.634).abs() < 0.03, "{ones}");
}

#[test]
fn sampler_top_p_keeps_only_the_nucleus() {
    // p = [0.1, 0.6, 0.3]: top_p 0.5 is {1}; 0.8 is {1, 2}.
    let logits = [1f32.ln(), 6f32.ln(), 3f32.ln()];
    assert!(draw(sampling(1.0, Some(0.5), 3), &logits, 500)
        .iter()
        .all(|&i| i == 1));
    let picks = draw(sampling(1.0, Some(0.8), 3), &logits, 2000);
    assert!(!picks.contains(&0));
    let twos = picks.iter().filter(|&&i| i == 2).count() as f64 / 2000.0;
    assert!((twos - 1.0 / 3.0).abs() < 0.04, "{twos}");
    // Same seed, same draws; another seed differs somewhere.
    let a = draw(sampling(1.0, Some(0.95), 9), &logits, 64);
    assert_eq!(a, draw(sampling(1.0, Some(0.95), 9), &logits, 64));
    assert_ne!(a, draw(sampling(1.0, Some(0.95), 10), &logits, 64));
}
